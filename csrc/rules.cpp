#include "rules.h"

#include <array>
#include <atomic>
#include <cstdlib>
#include <stdexcept>

#include "generated/rules_index.h"

namespace geot {

namespace {

bool parse_rules(const std::string& mode, const char* what) {
  if (mode == "learned") return true;
  if (mode == "heuristic") return false;
  throw std::invalid_argument(std::string(what) + " must be 'learned' or 'heuristic', got '" + mode + "'");
}

std::atomic<bool>& learned_enabled() {
  static std::atomic<bool> enabled{[] {
    const char* env = std::getenv("GEOT_RULES");
    return env == nullptr || *env == '\0' || parse_rules(env, "GEOT_RULES");
  }()};
  return enabled;
}

const std::array<int, generated::kRuleSets.size()> kKnownArchs = [] {
  std::array<int, generated::kRuleSets.size()> archs{};
  for (size_t i = 0; i < archs.size(); ++i) archs[i] = generated::kRuleSets[i].arch;
  return archs;
}();

const RuleSet* rule_set(int arch) {
  const int i = nearest_arch(arch, kKnownArchs.data(), int(kKnownArchs.size()));
  return i < 0 ? nullptr : &generated::kRuleSets[i];
}

using Selector = Config (*)(const Features&);

Selector family_selector(const RuleSet& rules, bool gathered) { return gathered ? rules.gathered : rules.plain; }

std::string sm(int arch) { return "sm_" + std::to_string(arch); }

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

std::vector<int> learned_archs() { return {kKnownArchs.begin(), kKnownArchs.end()}; }

std::vector<RuleSetInfo> learned_rule_sets() {
  std::vector<RuleSetInfo> sets;
  for (const RuleSet& rules : generated::kRuleSets)
    sets.push_back({rules.arch, rules.source, rules.plain != nullptr, rules.gathered != nullptr});
  return sets;
}

bool learned_config(const Features& f, Config* out) {
  if (!learned_enabled().load(std::memory_order_relaxed)) return false;
  const RuleSet* rules = rule_set(f.arch);
  if (rules == nullptr) return false;
  const Selector select = family_selector(*rules, f.gathered);
  if (select == nullptr) return false;
  *out = select(f);
  return true;
}

Config select_config(const Features& f) {
  Config cfg;
  return learned_config(f, &cfg) ? cfg : heuristic_config(f);
}

std::string config_source(const Features& f) {
  if (!learned_enabled().load()) return "hand heuristic (rules forced to 'heuristic')";
  const RuleSet* rules = rule_set(f.arch);
  if (rules == nullptr)
    return "hand heuristic (no learned rules for " + (f.arch > 0 ? sm(f.arch) : std::string("arch 0: CPU or unknown")) + ")";
  const char* family = f.gathered ? "gathered" : "plain";
  const std::string where = sm(rules->arch) + " from " + rules->source;
  if (family_selector(*rules, f.gathered) == nullptr)
    return std::string("hand heuristic (no learned rules for ") + family + " rows in " + where + ")";
  const std::string nearest = rules->arch == f.arch ? "" : " (nearest to " + sm(f.arch) + ")";
  return "learned rules " + where + nearest;
}

void set_rules(const std::string& mode) { learned_enabled().store(parse_rules(mode, "rules")); }

std::string rules_mode() { return learned_enabled().load() ? "learned" : "heuristic"; }

}  // namespace geot
