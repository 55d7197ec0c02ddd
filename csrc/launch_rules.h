// The config a CUDA call of the segment_reduce family launches: the learned
// rules' (or the caller's), then the hand rules for what the perf DB does not
// sweep yet (deterministic mode, fp16/bf16 rows, widths past F = 128, the
// shared-ids schedule). Plain C++, so that geot.explain(..., dtype=...)
// reports the launch the CUDA layer (segment_reduce_launch.cuh) makes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "config.h"
#include "segment_reduce.h"

namespace geot {

// What the launch rules see of a call.
struct LaunchCase {
  int64_t E, S, F;
  bool gathered;       // rows read through an index (the fused ops)
  bool half;           // fp16 / bf16 rows
  int64_t heads;       // weight heads of the fused ops (1: one weight an edge, or none)
  Reduce reduce;
  bool any_order;      // edges in any order: SR only
  bool caller_config;  // the caller gave the config: no hand rule changes it
  int long_segments;   // validation's long-segment level, -1 unknown
  bool det;            // deterministic mode (sorted input)
};

// A thread's N_t features must share one weight head.
inline Config with_head_aligned_n_t(Config c, int64_t F, int64_t heads) {
  while ((F / heads) % c.N_t != 0) c.N_t /= 2;
  return c;
}

// The shared-ids schedule's tile for rows of F: groups of 16 or 32 lanes
// (fewer where F is narrower), n_t features a lane, one column block each
// of a row's width * n_t features; m_t edges a group, 256 threads a block.
// Of 16 and 32 lanes it takes the one that leaves fewer lanes past F idle
// (32 on a tie): at F = 192 fp32 (48 lanes of 4 features) three blocks of
// 16 instead of two of 32 with 16 idle, as at F = 384 bf16. (H200, SpMM
// against 32 lanes: fp32 F = 192 1.09-1.22x as fast on 5 graphs of 88k to
// 8.4M edges, bf16 F = 384 1.06-1.25x on 5 of 3-12.8M edges, 0.90-0.99x on
// two of 88k-100k; 8-lane groups, which would idle no lane at fp32 F = 96
// and bf16 F = 192, lost up to 22% there.)
inline Config shared_ids_config(int64_t F, int n_t = 4, int m_t = 256) {
  const int64_t lanes = ceil_div(F, int64_t(n_t));
  int width = 1;
  while (width < 32 && width < lanes) width *= 2;
  if (width == 32 && ceil_div(lanes, int64_t(16)) * 16 < ceil_div(lanes, int64_t(32)) * 32) width = 16;
  return {n_t, width, m_t, 256 / width, 1};
}

// Lanes an edge's row takes in the shared-ids tile of n_t features a lane.
inline int64_t shared_ids_lanes(int64_t F, int n_t) {
  const Config tile = shared_ids_config(F, n_t);
  return int64_t(tile.T_N) * ceil_div(F, int64_t(n_t) * tile.T_N);
}

// Whether a graph is small for the shared-ids schedule: edges * lanes an
// edge (of n_t features a lane) <= 2^19, where groups of 16 edges leave
// SMs idle.
inline bool few_shared_ids_lanes(int64_t E, int64_t F, int n_t) {
  return E * shared_ids_lanes(F, n_t) <= (int64_t(1) << 19);
}

// Edges a group of the shared-ids tile walks (in deterministic mode, its
// chunk): 256 on graphs of 2^20 edges or more; on smaller ones 16-128, the
// power of two nearest to what spreads the edges over 2^17 lanes of 8
// features, and down to 4 where groups are of 8 lanes (F <= 64) or the
// graph is small (edges * lanes an edge <= 2^19): there 16 edges a group
// left most SMs idle (cora, bf16 F = 64: 21 blocks).
// (H100: on 88k-1M-edge graphs at F = 64-256, bf16, the kernel takes within
// 13% of the best of 16-128 edges a group; on 9k-100k-edge graphs at
// F = 64-512, bf16 and fp32, within 16%. The lower floor made SpMM on cora
// and citeseer at F = 64-256 1.03-1.45x as fast, on pubmed and a 100k-edge
// power-law graph at F = 64 1.13-1.17x; on cora at F = 512 and pubmed at
// F = 128 it lost 5-9%, so they keep 16.)
inline int shared_ids_rows(int64_t E, int64_t F) {
  if (E >= (int64_t(1) << 20)) return 256;
  const int64_t lanes_per_edge = shared_ids_lanes(F, 8);
  const bool few_lanes = shared_ids_config(F, 8).T_N <= 8 || few_shared_ids_lanes(E, F, 8);
  int m_t = few_lanes ? 4 : 16;
  while (m_t < 128 && int64_t(3 * m_t) << 16 <= E * lanes_per_edge) m_t *= 2;
  return m_t;
}

// The short-segment config. Deterministic mode where validation measured no
// segment over kLongSegmentRows[1] rows, on rows of up to
// short_segment_max_features:
// SP with its cap above every segment, so each segment is reduced whole by
// its thread group (a fixed shuffle order) and no chunk slots or combine run
// (launches that cost more than the reduction itself on graphs of 10^4-10^5
// edges). A segment walked whole costs rounds of loads for the longest one,
// so lanes split the rows: as many as keep a segment's group within 64
// threads and all groups within 2^18 * sqrt(column threads) threads (more
// lanes for the longest segment, fewer threads in all; wider rows take more).
// Features go 4 to a thread where the head size allows. Wider rows keep the
// learned tiles with 16-row chunks and the one-pass combine. Chosen
// on an H100 from every SP tiling of cora, citeseer and pubmed at F = 1-128,
// both ops; deterministic / default time per graph at the geomean then went
// from 1.25, 1.25, 1.30 to 1.12, 1.05, 1.12 (plain rows) and from 1.25,
// 1.25, 1.80 to 1.24, 1.12, 1.61 (gathered).
inline int64_t short_segment_max_features(bool gathered) { return gathered ? 32 : 128; }

inline Config short_segment_config(int64_t S, int64_t F, int64_t heads) {
  const int n_t = with_head_aligned_n_t(Config{4, 0, 0, 0, 0}, F, heads).N_t;
  const int64_t columns = ceil_div(F, n_t);
  int column_threads = 1;
  while (column_threads < columns && column_threads < 256) column_threads *= 2;
  constexpr int kGroupThreads = 64;
  const double thread_budget = double(int64_t(1) << 18) * std::sqrt(double(column_threads));
  int lanes = 1;
  while (lanes < 32 && 2 * lanes * column_threads <= kGroupThreads &&
         double(S) * 2 * lanes * column_threads <= thread_budget)
    lanes *= 2;
  const int t_n = column_threads * lanes;
  return {n_t, t_n, static_cast<int>(ceil_div(kLongSegmentRows[1], lanes)), std::max(1, 256 / t_n), 0};
}

// Half rows on small graphs take that config outside deterministic mode too,
// where it covers them: one launch storing the output directly, where SR's
// half rows take a memset of chunk slots, an offsets pass, the reduction and
// a finalize pass, launches that cost more host time than the reduction
// takes. H100, cora and citeseer, bf16 and fp16, gathered F = 16-32 and plain
// F = 16-64: eager calls from 31-47 to 11-14 us, CUDA-graph replays 0.89-1.72x
// as fast; gathered F = 64 on cora (0.69x), plain F = 128 (0.55x) and pubmed's
// 88k edges lost in replays.
inline bool half_short_segments(const LaunchCase& k) {
  return k.half && !k.any_order && k.E < (int64_t(1) << 16) && k.F <= (k.gathered ? 32 : 64);
}

// Gathered sums (and means) of rows of 64 features or more: SR with shared
// ids, groups of up to a warp (shared_ids_rows edges each; in deterministic
// mode a group's edges are its chunk), where
//  * the graph has 2^20 edges or more and segments over kLongSegmentRows[1]
//    rows: there the learned configs lost to cuSPARSE's SpMM
//    (bench/spmm.py), whose row loads this schedule matches;
//  * rows are fp16/bf16 of a multiple of 8 features: the rules' tiles,
//    learned on fp32 rows, took 1.1-1.4x as long as this schedule's 8
//    features a lane on uniform graphs of 3.2M and 12.8M edges
//    (F = 64-512) and up to 2.4x on 9k-100k-edge graphs;
//  * fp32 rows of 128 features or more on graphs under 2^20 edges: the perf
//    DB sweeps F <= 128, and past it the rules' SR tiles took up to 1.8x as
//    long on 9k-100k-edge graphs (F = 192-512; at F = 128 0.96-1.5x, at
//    F = 64-96 cora's won).
// In deterministic mode the last two only on graphs under 2^20 edges whose
// segments validation bounds to kLongSegmentRows[2] rows (the one-pass
// combine), with chunks of 32 edges or more past kLongSegmentRows[1] rows
// (16 took 1.25x as long on a 100k-edge graph with a 5k-edge hub at
// F = 128): on cora, citeseer and pubmed (fp32, F = 128-512) the
// deterministic time went from 1.7-3.0x the default's to 1.35-1.9x; on that
// hub graph, fp16/bf16 F = 64-512, from 1.4-2.7x to 1.3-2.0x, fp32
// F = 256-512 from 1.8-1.9x to 1.5-1.8x (F = 128: 2.0x to 2.1x).
// A hand rule until the perf DB sweeps the schedule (H100 figures).
inline bool use_shared_ids(const LaunchCase& k) {
  const bool fits = k.gathered && k.heads == 1 && (k.reduce == Reduce::Sum || k.reduce == Reduce::Mean) &&
                    !k.any_order && !k.caller_config && k.F >= 64 && k.F % 4 == 0;
  const bool large = k.E >= (int64_t(1) << 20);
  const bool skewed = large && k.long_segments >= 2;
  const bool wide_rows = k.half ? k.F % 8 == 0 : k.F >= 128 && !large;
  const bool bounded_segments = !large && k.long_segments >= 0 && k.long_segments <= 2;
  return fits && (skewed || (wide_rows && (!k.det || bounded_segments)));
}

// That schedule's tile: 8 features a lane for half rows outside
// deterministic mode (the launch falls back to 4 where rows are unaligned).
// In deterministic mode a group's edges are its chunk: at least 16, fewer
// slots to combine; 8 on small graphs (the launch's lanes: 8 features a
// lane for half rows, 4 for others), 32 past 1024-row segments. (H100,
// SpMM, deterministic / default time at 16 -> 8 edges: cora and citeseer,
// bf16 F = 64-128, 1.23-1.36 -> 1.06-1.15, F = 256 1.08-1.19 -> 1.07, fp32
// F = 128 1.81-1.88 -> 1.61-1.79; 8 edges lost 9-14% at fp32 F = 256 there
// (so the lanes count), 4 edges 12-18% at bf16 F = 256, and 8 edges up to
// 1.3x on pubmed and a 100k-edge power-law graph at F = 64.)
inline Config shared_ids_tile(const LaunchCase& k) {
  int m_t = shared_ids_rows(k.E, k.F);
  if (k.det) {
    const bool small = few_shared_ids_lanes(k.E, k.F, k.half ? 8 : 4);
    m_t = std::max(m_t, k.long_segments >= 2 ? 32 : small ? 8 : 16);
  }
  return shared_ids_config(k.F, k.half && !k.det && k.F % 8 == 0 ? 8 : 4, m_t);
}

// fp16/bf16 gathered rows on the rules' SP tile of 8 lanes a row take 16 and
// 4 segments a block, where F fills the wider tile. The rules learn fp32
// cells, and that tile leaves half rows half the bytes in flight per lane.
// H100, bf16 SpMM, (4, 8, 64, 32, SP) -> (4, 16, 64, 4, SP): 3.2M-edge
// uniform graph (degree 16) 1.17-1.19x at F = 64-256, 12.8M-edge (degree 32)
// 1.27-1.45x; slower at F <= 32 and for fp32 rows, and SR tiles did not
// gain. (The H200's rules pick 16 lanes for such graphs already.) Not for a
// config the caller gave, nor in deterministic mode (measured as it is).
inline Config half_row_sp_config(Config c, const LaunchCase& k) {
  if (k.half && k.gathered && !k.det && !k.caller_config && c.is_sp() && c.N_t == 4 && c.T_N == 8 &&
      k.F % 64 == 0) {
    c.T_N = 16;
    c.T_M = 4;
  }
  return c;
}

// Deterministic mode, fp32 / fp64 sums and means of one weight head on
// graphs under 2^20 edges: a PR tile of 64-row chunks (32 lanes of n_t
// features, groups of 64 / M_t lanes with M_t rows each; M_t = F / 4 within
// 2..8) where
//  * validation measured a segment over kLongSegmentRows[1] rows and
//    F <= 32 (both ops), where the rules' SR tiles map to 16-row chunks
//    (four times the slots for the combine);
//  * no segment is that long, the rows are gathered, the rules' config is
//    not SP already and either F <= 32 on 2^15 edges or more (where short-
//    segment SP's thread budget leaves a segment's group few lanes) or
//    32 < F <= 64 under 2^15 edges (16-row chunks: M_t = 2, groups of 8).
// (H200, every PR tile (n_t, 32, 1-16, 8, 8-32) timed against the launch it
// replaces: a 10^5-edge power-law graph, F = 1-32, both ops, deterministic
// time 17.8-27.6 -> 13.0-25.3 us (default mode: 10.3-14.7); pubmed's
// gathered F = 1-32 15.1-32.8 -> 14.3-25.3; cora's and citeseer's gathered
// F = 64 19.1-19.8 -> 15.1-15.5. Short-segment SP kept its cells: plain rows
// of pubmed, where PR took 1.2-1.6x as long, and gathered F <= 32 on cora,
// citeseer and a uniform 128k-edge graph.)
inline bool deterministic_pr_rows(const LaunchCase& k, const Config& c) {
  const bool fits = k.det && !k.half && !k.caller_config && k.heads == 1 && !k.any_order &&
                    (k.reduce == Reduce::Sum || k.reduce == Reduce::Mean) && k.E < (int64_t(1) << 20);
  if (!fits) return false;
  if (k.long_segments == 2) return k.F <= 32;
  const bool short_rows = k.long_segments >= 0 && k.long_segments <= 1 && k.gathered && !c.is_sp();
  const bool tiny = k.E < (int64_t(1) << 15);
  return short_rows && (tiny ? k.F > 32 && k.F <= 64 : k.F <= 32);
}

inline Config deterministic_pr_config(int64_t F) {
  const int n_t = widest_vector(F);
  if (F > 32) return {n_t, 32, 2, 8, 8};
  int m_t = 2;
  while (m_t < 8 && 4 * m_t < F) m_t *= 2;
  return {n_t, 32, m_t, 8, 64 / m_t};
}

// Deterministic mode: the rules' SP where a segment may pass its cap
// (validation's level 2 or 3) takes SR with the same tiles. SP's counterpart
// runs the SP pass, an SR pass over every row's chunk for the segments it
// left whole, then the combine; SR's chunks take the rows once. (H200,
// plain fp32 rows, 3.0M and 3.3M-edge graphs with hubs, F = 8-128:
// deterministic time 1.20-1.47x as fast, e.g. F = 16 on the power-law graph
// 164 -> 112 us.) Not for a config the caller gave (its counterpart is as
// documented).
inline bool deterministic_sp_as_sr(const LaunchCase& k, const Config& c) {
  return k.det && !k.half && !k.caller_config && c.is_sp() && k.long_segments >= 2;
}

// Whether a call that does not take shared ids launches the short-segment
// config instead of the rules' config c.
inline bool short_segments(const LaunchCase& k, const Config& c) {
  const bool covered = k.det ? k.F <= short_segment_max_features(k.gathered) : half_short_segments(k);
  return covered && !k.caller_config && !c.is_sp() && k.long_segments >= 0 && k.long_segments <= 1;
}

// The rules' config c (or the caller's) as a call that does not take shared
// ids launches it: the short-segment config where it serves; for edges in
// any order, which only SR takes, an SR tile of 4 rows a thread; then the
// half-row SP tile.
inline Config tiled_config(const LaunchCase& k, const Config& c) {
  Config tile = c;
  if (deterministic_pr_rows(k, c)) {
    tile = deterministic_pr_config(k.F);
  } else if (deterministic_sp_as_sr(k, c)) {
    tile.G_t = 1;
  } else if (short_segments(k, c)) {
    tile = short_segment_config(k.S, k.F, k.heads);
  } else if (k.any_order && !c.is_sr()) {
    const int n_t = widest_vector(k.F);
    const int t_n = static_cast<int>(std::clamp<int64_t>(ceil_div(k.F, n_t), 8, 64));
    tile = {n_t, t_n, 4, std::max(1, 256 / t_n), 1};
  }
  return half_row_sp_config(tile, k);
}

// The config the call launches, from the rules' (or the caller's).
inline Config launch_config(const LaunchCase& k, const Config& rules) {
  return use_shared_ids(k) ? shared_ids_tile(k) : tiled_config(k, rules);
}

// Which hand rule launch_config applies to the rules' config, for
// geot.explain; null: none.
inline const char* launch_rule(const LaunchCase& k, const Config& rules) {
  if (use_shared_ids(k)) return "SR with shared ids (use_shared_ids)";
  if (deterministic_pr_rows(k, rules)) return "deterministic PR of 64-row chunks (deterministic_pr_config)";
  if (deterministic_sp_as_sr(k, rules)) return "deterministic SR for an SP that may overflow (deterministic_sp_as_sr)";
  if (short_segments(k, rules))
    return k.det ? "deterministic short-segment SP (short_segment_config)"
                 : "half rows on a small graph: short-segment SP (half_short_segments)";
  if (k.any_order && !rules.is_sr()) return "edges in any order: an SR tile";
  if (half_row_sp_config(rules, k).T_N != rules.T_N)
    return "half rows on SP's 8-lane tile: 16 lanes (half_row_sp_config)";
  return nullptr;
}

}  // namespace geot
