#include "config.h"

#include <algorithm>
#include <stdexcept>

namespace geot {

namespace {

int widest_vector(int64_t F) { return F % 4 == 0 ? 4 : (F % 2 == 0 ? 2 : 1); }

int next_pow2(int64_t v) {
  int p = 1;
  while (p < v && p < (1 << 30)) p <<= 1;
  return p;
}

}  // namespace

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

Config heuristic_config(const Features& f) {
  const bool small = f.E < (int64_t(1) << 18);  // latency-bound: a few waves at most
  if (small) {
    // Short rows per thread and one feature per thread: the most parallelism.
    const int n_t = f.F > 16 && f.F % 2 == 0 ? 2 : 1;
    const int t_n = std::clamp(next_pow2((f.F + n_t - 1) / n_t), 16, 64);
    return {n_t, t_n, f.avg < 8.0 ? 8 : 16, 4, 1};
  }
  const int n_t = widest_vector(f.F);
  if (f.F <= 4) return {n_t, 32, 8, 8, 32};    // PR: lanes over rows keep loads coalesced
  if (f.F < 16) return {n_t, 32, 16, 8, 16};   // PR, half-warp tiles
  if (f.F < 32) return {1, std::min(64, next_pow2(f.F)), 64, 4, 1};  // SR, a warp per row slice
  // SP: no atomics, no pre-fill; within ~10% of the best on even degrees,
  // where torch.segment_reduce is strong, and hubs overflow into SR.
  const int sp_n_t = f.F >= 64 ? n_t : std::min(n_t, 2);
  const int t_n = std::clamp(next_pow2((f.F + sp_n_t - 1) / sp_n_t), 16, 64);
  return {sp_n_t, t_n, 64, 256 / t_n, 0};
}

// Numbers go through std::to_string, never an ostream: see segment_reduce.h.
std::string config_to_string(const Config& c) {
  using std::to_string;
  return std::string(c.is_sr() ? "SR" : c.is_sp() ? "SP" : "PR") + "<N_t=" + to_string(c.N_t) +
         ", T_N=" + to_string(c.T_N) + ", M_t=" + to_string(c.M_t) + ", T_M=" + to_string(c.T_M) +
         ", G_t=" + to_string(c.G_t) + ">";
}

}  // namespace geot
