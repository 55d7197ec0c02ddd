// Learned config rules: decision trees trained on a GPU's perf database by
// scripts/train_tree.py, one generated header per architecture
// (generated/rules_sm<major><minor>.h, listed in generated/rules_index.h).
// Plain C++ (no torch), so a test can compile a generated header alone.
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include "config.h"

namespace geot {

// What the trees split on, all O(1) from Features. The formulae must equal
// rule_features() in scripts/train_tree.py: the thresholds are float64
// midpoints between training values computed there.
struct RuleInputs {
  double log2_E, log2_S, avg, F, long_level;
};

inline RuleInputs rule_inputs(const Features& f) {
  return {std::log2(double(f.E > 1 ? f.E : 1)), std::log2(double(f.num_segments > 1 ? f.num_segments : 1)), f.avg,
          double(f.F), f.long_segments < 0 ? 3.0 : double(f.long_segments)};  // unknown: the most skewed, the safe side
}

// One architecture's rules; a family without a perf DB has no selector.
struct RuleSet {
  int arch;            // major * 10 + minor
  const char* source;  // the perf DB it was trained on, "perfdb/<gpu>"
  Config (*plain)(const Features&);
  Config (*gathered)(const Features&);
};

// Index into known[0..n) of the rules for arch: the exact architecture, else
// the nearest one of the same major version (the lower one on a tie), else -1.
int nearest_arch(int arch, const int* known, int n);

// The architectures with learned rules (generated/rules_index.h).
std::vector<int> learned_archs();

// One compiled-in rule set: its architecture, the perf DB it was trained on
// and which families (plain rows, gathered rows) it has rules for.
struct RuleSetInfo {
  int arch;
  std::string source;
  bool plain, gathered;
};
std::vector<RuleSetInfo> learned_rule_sets();

// The learned rules' config for f (sorted reductions) on f.arch; false if
// there are none for it or the hand heuristic is forced.
bool learned_config(const Features& f, Config* out);

// Learned rules where there are some, else heuristic_config.
Config select_config(const Features& f);

// Which selector select_config(f) uses and why, e.g.
// "learned rules sm_90 from perfdb/nvidia-h100-80gb-hbm3" or
// "hand heuristic (no learned rules for sm_80)".
std::string config_source(const Features& f);

// "learned" (default) or "heuristic": the latter forces the hand heuristic,
// to compare both in one build. Starts from the environment variable
// GEOT_RULES, read once; throws std::invalid_argument on another value.
void set_rules(const std::string& mode);
std::string rules_mode();

}  // namespace geot
