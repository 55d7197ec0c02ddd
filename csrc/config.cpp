#include "config.h"

#include <algorithm>
#include <stdexcept>

namespace geot {

namespace {

int next_pow2(int64_t v) {
  int p = 1;
  while (p < v && p < (1 << 30)) p <<= 1;
  return p;
}

// Narrow SR/SP tiling: the T_N threads of a row cover its F features with
// N_t each, so small F does not leave lanes idle.
Config narrow(int n_t, int64_t F, int m_t, int g_t) {
  const int t_n = std::min(64, next_pow2((F + n_t - 1) / n_t));
  return {n_t, t_n, m_t, std::max(1, 256 / t_n), g_t};
}

Config small_graph_config(const Features& f) {
  // Short rows per thread and one feature per thread: the most parallelism.
  if (f.gathered && f.F >= 64) return narrow(widest_vector(f.F), std::min<int64_t>(f.F, 128), 16, 1);
  const int n_t = f.F > 16 && f.F % 2 == 0 ? 2 : 1;
  const int t_n = std::clamp(next_pow2((f.F + n_t - 1) / n_t), 16, 64);
  return {n_t, t_n, f.avg < 8.0 ? 8 : 16, 4, 1};
}

// SP: no atomics, no pre-fill, a segment per thread group; rows past 64 in a
// segment overflow into SR.
Config segment_parallel(const Features& f) {
  const int n_t = f.F >= 64 ? widest_vector(f.F) : std::min(widest_vector(f.F), 2);
  const int t_n = std::clamp(next_pow2((f.F + n_t - 1) / n_t), 16, 64);
  return {n_t, t_n, 64, 256 / t_n, 0};
}

// Small F: lanes over rows (PR) keep loads coalesced and, unlike short SR
// runs, do not pile atomics onto a hub's output row.
Config small_f_config(const Features& f) {
  const int n_t = widest_vector(f.F);
  if (f.F <= 4) return {n_t, 32, 8, 8, 32};   // PR
  if (f.F < 16) return {n_t, 32, 16, 8, 16};  // PR, half-warp tiles
  return {1, std::min(64, next_pow2(f.F)), 64, 4, 1};  // SR, a warp per row slice
}

Config gathered_config(const Features& f) {
  if (f.F < 32) return small_f_config(f);
  // Even degrees (no segment over 64 rows): SP. Skewed or unknown: SR with
  // long runs, which SP loses to by up to 2x on power-law graphs.
  if (f.long_segments == 0) return segment_parallel(f);
  return narrow(widest_vector(f.F), std::min<int64_t>(f.F, 128), 64, 1);
}

Config plain_config(const Features& f) {
  if (f.F == 1) return {1, 32, 8, 8, 32};  // PR
  // Even degrees: narrow SR with short runs, within ~5% of
  // torch.segment_reduce (which reads precomputed offsets, no index).
  if (f.F < 32 && f.long_segments == 0) return narrow(f.F % 2 == 0 ? 2 : 1, f.F, 8, 1);
  if (f.F < 32) return small_f_config(f);
  return segment_parallel(f);
}

}  // namespace

Config heuristic_config(const Features& f) {
  if (f.E < (int64_t(1) << 18)) return small_graph_config(f);  // latency-bound: a few waves at most
  return f.gathered ? gathered_config(f) : plain_config(f);
}

void check_config(const Config& c) {
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument("config " + config_to_string(c) + ": " + why);
  };
  if (c.N_t != 1 && c.N_t != 2 && c.N_t != 4) fail("N_t must be 1, 2 or 4");
  if (c.T_N < 1 || c.T_M < 1 || c.T_N * c.T_M > 1024) fail("need T_N, T_M >= 1 and T_N * T_M <= 1024");
  if (c.M_t < 1 || c.M_t > 4096) fail("M_t must be in [1, 4096]");
  if (c.G_t < 0 || c.G_t > 32 || (c.G_t & (c.G_t - 1)) != 0)
    fail("G_t must be 0 (SP), 1 (SR) or a power of two up to 32 (PR)");
}

// Numbers go through std::to_string, never an ostream: see segment_reduce.h.
std::string config_to_string(const Config& c) {
  using std::to_string;
  return std::string(c.is_sr() ? "SR" : c.is_sp() ? "SP" : "PR") + "<N_t=" + to_string(c.N_t) +
         ", T_N=" + to_string(c.T_N) + ", M_t=" + to_string(c.M_t) + ", T_M=" + to_string(c.T_M) +
         ", G_t=" + to_string(c.G_t) + ">";
}

}  // namespace geot
