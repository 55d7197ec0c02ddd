#include "rules.h"

#include <array>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <stdexcept>

#include "generated/rules_index.h"

namespace geot {

namespace {

constexpr int kRuleSetCount = generated::kRuleSets.size();

// What set_rules forces: kAuto (each device's own rule set), kHeuristic, or
// a rule set's index.
constexpr int kAuto = -2, kHeuristic = -1;

int rule_set_by_slug(const std::string& slug) {
  for (int i = 0; i < kRuleSetCount; ++i)
    if (slug == generated::kRuleSets[i].slug) return i;
  return -1;
}

std::string rule_set_slugs() {
  std::string slugs;
  for (const RuleSet& rules : generated::kRuleSets) slugs += std::string(", '") + rules.slug + "'";
  return slugs;
}

int parse_rules(const std::string& mode, const char* what) {
  if (mode == "learned") return kAuto;
  if (mode == "heuristic") return kHeuristic;
  const int i = rule_set_by_slug(mode);
  if (i >= 0) return i;
  throw std::invalid_argument(std::string(what) + " must be 'learned', 'heuristic' or a rule set" +
                              rule_set_slugs() + "; got '" + mode + "'");
}

std::atomic<int>& forced_rules() {
  static std::atomic<int> forced{[] {
    const char* env = std::getenv("GEOT_RULES");
    return env == nullptr || *env == '\0' ? kAuto : parse_rules(env, "GEOT_RULES");
  }()};
  return forced;
}

const std::array<int, generated::kArchFallbacks.size()> kFallbackArchs = [] {
  std::array<int, generated::kArchFallbacks.size()> archs{};
  for (size_t i = 0; i < archs.size(); ++i) archs[i] = generated::kArchFallbacks[i].arch;
  return archs;
}();

using Selector = Config (*)(const Features&);

Selector family_selector(const RuleSet& rules, bool gathered) { return gathered ? rules.gathered : rules.plain; }

// The rule set in force for f (-1: none, the heuristic): forced by
// set_rules, else the device's own. One relaxed load per call.
int rules_in_force(const Features& f) {
  if (f.rules < -1) return -1;
  const int forced = forced_rules().load(std::memory_order_relaxed);
  return forced == kAuto ? f.rules : forced;
}

std::string sm(int arch) { return "sm_" + std::to_string(arch); }

std::string why(const RuleChoice& choice, int used) {
  if (forced_rules().load() != kAuto) return "forced by GEOT_RULES / geot.set_rules";
  const RuleSet& rules = generated::kRuleSets[used];
  if (choice.match == RuleMatch::Model) return std::string("trained on this GPU model, ") + rules.device;
  const std::string fallback = sm(rules.arch) + " fallback: no rules for this GPU model";
  return rules.arch == choice.arch ? fallback : fallback + ", nearest architecture to " + sm(choice.arch);
}

}  // namespace

int nearest_arch(int arch, const int* known, int n) {
  int best = -1;
  for (int i = 0; i < n; ++i) {
    if (known[i] == arch) return i;
    if (arch <= 0 || known[i] / 10 != arch / 10) continue;
    const int distance = std::abs(known[i] - arch), best_distance = best < 0 ? 0 : std::abs(known[best] - arch);
    if (best < 0 || distance < best_distance || (distance == best_distance && known[i] < known[best])) best = i;
  }
  return best;
}

std::string device_slug(const std::string& name) {
  std::string slug;
  bool dash = false;
  for (const char c : name) {
    if (std::isalnum(static_cast<unsigned char>(c))) {
      if (dash && !slug.empty()) slug += '-';
      slug += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      dash = false;
    } else {
      dash = true;
    }
  }
  return slug;
}

RuleChoice choose_rules(const std::string& device_name, int arch) {
  const int model = device_name.empty() ? -1 : rule_set_by_slug(device_slug(device_name));
  if (model >= 0) return {model, RuleMatch::Model, arch};
  const int i = nearest_arch(arch, kFallbackArchs.data(), int(kFallbackArchs.size()));
  if (i < 0) return {-1, RuleMatch::None, arch};
  return {generated::kArchFallbacks[i].rule_set, RuleMatch::Arch, arch};
}

std::vector<int> learned_archs() { return {kFallbackArchs.begin(), kFallbackArchs.end()}; }

std::vector<RuleSetInfo> learned_rule_sets() {
  std::vector<RuleSetInfo> sets;
  for (int i = 0; i < kRuleSetCount; ++i) {
    const RuleSet& rules = generated::kRuleSets[i];
    bool fallback = false;
    for (const ArchFallback& f : generated::kArchFallbacks) fallback |= f.rule_set == i;
    sets.push_back({rules.slug, rules.device, rules.arch, rules.source, rules.plain != nullptr,
                    rules.gathered != nullptr, fallback});
  }
  return sets;
}

bool learned_config(const Features& f, Config* out) {
  const int i = rules_in_force(f);
  if (i < 0 || i >= kRuleSetCount) return false;
  const Selector select = family_selector(generated::kRuleSets[i], f.gathered);
  if (select == nullptr) return false;
  *out = select(f);
  return true;
}

Config select_config(const Features& f) {
  Config cfg;
  return learned_config(f, &cfg) ? cfg : heuristic_config(f);
}

std::string config_source(const Features& f, const RuleChoice& choice) {
  if (f.rules >= -1 && forced_rules().load() == kHeuristic) return "hand heuristic (rules forced to 'heuristic')";
  const int used = rules_in_force(f);
  if (used < 0 || used >= kRuleSetCount) {
    const std::string arch = choice.arch > 0 ? sm(choice.arch) : std::string("arch 0: CPU or unknown");
    return "hand heuristic (no learned rules for " + arch + ")";
  }
  const RuleSet& rules = generated::kRuleSets[used];
  const std::string where = std::string(rules.slug) + " from " + rules.source;
  if (family_selector(rules, f.gathered) == nullptr)
    return std::string("hand heuristic (no learned rules for ") + (f.gathered ? "gathered" : "plain") +
           " rows in " + where + ")";
  return "learned rules " + where + " (" + why(choice, used) + ")";
}

void set_rules(const std::string& mode) { forced_rules().store(parse_rules(mode, "rules")); }

std::string rules_mode() {
  const int forced = forced_rules().load();
  if (forced == kAuto) return "learned";
  return forced == kHeuristic ? "heuristic" : generated::kRuleSets[forced].slug;
}

}  // namespace geot
