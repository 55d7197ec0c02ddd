// Learned config rules: decision trees trained on a GPU's perf database by
// scripts/train_tree.py, one generated header per GPU model
// (generated/rules_<gpu-slug>.h, listed in generated/rules_index.h with the
// rule set each architecture falls back to). Plain C++ (no torch), so a test
// can compile a generated header alone.
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include "config.h"

namespace geot {

// What the trees split on, all O(1) from Features. The formulae must equal
// rule_features() in scripts/train_tree.py: the thresholds are float64
// midpoints between training values computed there.
// skew_lo, skew_hi: log2 of the long level's lower and upper bounds on the
// longest segment (over 1, 64, 1024, 16384 rows; at most 64, 1024, 16384
// rows, and E) over the mean segment.
struct RuleInputs {
  double log2_E, log2_S, avg, F, long_level, skew_lo, skew_hi;
};

inline RuleInputs rule_inputs(const Features& f) {
  constexpr double kFloorLog2[4] = {0.0, 6.0, 10.0, 14.0};  // log2 of 1 and kLongSegmentRows
  constexpr double kCeilLog2[4] = {6.0, 10.0, 14.0, HUGE_VAL};
  // unknown (-1): the most skewed, the safe side
  const int level = f.long_segments < 0 || f.long_segments > 3 ? 3 : f.long_segments;
  const double log2_E = std::log2(double(f.E > 1 ? f.E : 1));
  const double log2_S = std::log2(double(f.num_segments > 1 ? f.num_segments : 1));
  const double log2_avg = log2_E - log2_S;
  const double ceil = kCeilLog2[level] < log2_E ? kCeilLog2[level] : log2_E;
  return {log2_E, log2_S, f.avg, double(f.F), double(level), kFloorLog2[level] - log2_avg, ceil - log2_avg};
}

// One GPU model's rules; a family without a perf DB has no selector.
struct RuleSet {
  const char* slug;    // the device name as bench/common.py's device_slug makes it: "nvidia-h100-80gb-hbm3"
  const char* device;  // the device name its perf DB was swept on: "NVIDIA H100 80GB HBM3"
  int arch;            // major * 10 + minor
  const char* source;  // the perf DB it was trained on, "perfdb/<slug>"
  Config (*plain)(const Features&);
  Config (*gathered)(const Features&);
};

// The rule set a GPU of an architecture without rules of its own model uses.
struct ArchFallback {
  int arch;
  int rule_set;  // index into the rule sets
};

// Index into known[0..n) of the rules for arch: the exact architecture, else
// the nearest one of the same major version (the lower one on a tie), else -1.
int nearest_arch(int arch, const int* known, int n);

// "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3" (lower case, runs of
// other characters one dash), as bench/common.py's device_slug.
std::string device_slug(const std::string& name);

// Why a device got its rule set.
enum class RuleMatch : int { None = 0, Model = 1, Arch = 2 };

// A device's rules: index (-1: none, the hand heuristic) and why.
struct RuleChoice {
  int index = -1;
  RuleMatch match = RuleMatch::None;
  int arch = 0;
};

// The rule set trained on this GPU model (device name, or its slug), else
// the architecture's fallback (exact, else nearest of the same major), else
// none. String work: the runtime calls it once per device and caches the
// index (Features::rules).
RuleChoice choose_rules(const std::string& device_name, int arch);

// One compiled-in rule set: its slug, device, architecture, the perf DB it
// was trained on, which families (plain rows, gathered rows) it has rules
// for, and whether it is its architecture's fallback.
struct RuleSetInfo {
  std::string slug, device;
  int arch;
  std::string source;
  bool plain, gathered, arch_fallback;
};
std::vector<RuleSetInfo> learned_rule_sets();

// The architectures with a fallback rule set.
std::vector<int> learned_archs();

// The config of the rule set in force for f (f.rules, unless set_rules
// forces another or the heuristic); false if it has none for f's family.
bool learned_config(const Features& f, Config* out);

// Learned rules where there are some, else heuristic_config.
Config select_config(const Features& f);

// Which selector select_config(f) uses and why, for f.rules == choice.index:
// "learned rules nvidia-h200 from perfdb/nvidia-h200 (this GPU model)",
// "learned rules ... (sm_90 fallback: no rules for this GPU model)" or
// "hand heuristic (no learned rules for sm_80)".
std::string config_source(const Features& f, const RuleChoice& choice);

// "learned" (default: each device's own rules), "heuristic" (the hand
// heuristic everywhere) or a rule set's slug (that rule set everywhere), to
// compare them in one build. Starts from the environment variable
// GEOT_RULES, read once; throws std::invalid_argument on another value.
void set_rules(const std::string& mode);
std::string rules_mode();

}  // namespace geot
