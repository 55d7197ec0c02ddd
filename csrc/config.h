// Kernel configuration <N_t, T_N, M_t, T_M, G_t> and the hand-written
// heuristic that picks one. Plain C++: used by the launch layer and by Python
// (geot.explain) through the extension module.
#pragma once

#include <cstdint>
#include <string>

namespace geot {

enum class Reduce : int { Sum = 0, Mean = 1, Max = 2, Min = 3 };

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The most features a thread can load as one vector from rows of F: 4, 2 or 1.
inline int widest_vector(int64_t F) { return F % 4 == 0 ? 4 : (F % 2 == 0 ? 2 : 1); }

// N_t: features per thread (1, 2 or 4; a register array, so a template
//      parameter of the kernels).
// T_N: threads along the feature dimension in a block (SR), or, with T_M,
//      just the block size T_N * T_M (PR).
// M_t: rows each thread walks (SR) or row iterations of a thread tile (PR).
// T_M: thread groups along rows in a block.
// G_t: 1 = sequential reduction (SR); 8/16/32 = parallel reduction (PR) by a
//      tile of G_t lanes that reduce consecutive rows with warp shuffles;
//      0 = segment parallel (SP): a thread group per segment, no atomics, for
//      up to M_t rows per lane of each segment (the rest goes through SR);
//      the T_N threads that F / N_t features leave over become row lanes
//      (a power of two up to 32) that split the segment.
struct Config {
  int N_t, T_N, M_t, T_M, G_t;
  bool is_sr() const { return G_t == 1; }
  bool is_sp() const { return G_t == 0; }
  bool is_pr() const { return G_t > 1; }
};

// Graph features the selectors see. avg is E / num_segments as a float;
// gathered: the fused ops' kernel family (rows read through src_index, at
// random, rather than streamed), which wants other tilings; long_segments:
// how many of 64, 1024 and 16384 rows the longest segment exceeds (0..3;
// kLongSegmentRows), -1 unknown (a by-product of index validation, cached
// per index; unknown when validation is off);
// rules: the learned rule set of the GPU (rules.h: an index chosen once per
// device, by its model, else its architecture); -1 = none (CPU, unknown
// GPU): the hand heuristic unless set_rules forces a rule set; -2: the hand
// heuristic whatever is forced (reductions the rules were not trained on).
struct Features {
  int64_t E, num_segments, F;
  double avg;
  bool gathered;
  int long_segments;
  int rules;
};

inline Features make_features(int64_t E, int64_t num_segments, int64_t F, bool gathered, int long_segments,
                              int rules) {
  double avg = num_segments > 0 ? double(E) / double(num_segments) : double(E);
  return {E, num_segments, F, avg, gathered, long_segments, rules};
}

// Throws std::invalid_argument with a readable message if cfg is unusable.
void check_config(const Config& cfg);

// The baseline the learned rules must beat, read off H100 probes
// (docs/design.md, "Dispatch"):
//  * E < 2^18 (latency-bound): SR, one feature per thread, M_t 8 or 16;
//    gathered rows with F >= 64: SR, 4 features per thread, M_t 16.
//  * F <= 4: PR with 32-lane tiles; F < 16: PR with 16-lane tiles; F < 32:
//    SR with a warp across the features and M_t = 64. Except for plain rows
//    of an index with no segment over 64 rows (even degrees): SR, narrow
//    (a row's features span only F / N_t threads), M_t 8.
//  * F >= 32: SP capped at 64 rows per segment (longer ones overflow to SR);
//    for gathered rows only without long segments, else SR with 4 features
//    per thread and M_t 64 (SP loses up to 2x on power-law graphs there).
Config heuristic_config(const Features& f);

std::string config_to_string(const Config& cfg);

}  // namespace geot
