#include "index_cache.h"

#include <c10/util/intrusive_ptr.h>

#include <array>
#include <future>
#include <mutex>
#include <optional>
#include <vector>

#include "segment_reduce.h"
#include "uninitialized.h"

namespace geot {

namespace {

// Identity of an index tensor's values: equal keys, equal values.
struct IndexKey {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage{c10::intrusive_ptr<c10::StorageImpl>()};
  int64_t offset = 0, numel = 0, stride = 0, version = -1;
  at::ScalarType dtype = at::kLong;

  explicit IndexKey(const at::Tensor& index)
      : storage(index.storage().getWeakStorageImpl()),
        offset(index.storage_offset()),
        numel(index.numel()),
        stride(index.stride(0)),
        version(int64_t(index._version())),
        dtype(index.scalar_type()) {}
  IndexKey() = default;

  bool expired() const { return storage.expired(); }
  bool matches(const at::Tensor& index) const {
    return !storage.expired() && storage._unsafe_get_target() == index.storage().unsafeGetStorageImpl() &&
           offset == index.storage_offset() && numel == index.numel() && stride == index.stride(0) &&
           dtype == index.scalar_type() && version == int64_t(index._version());
  }
};

// A small round-robin cache: a few graphs (and their transposes) in flight.
template <typename Value, size_t N>
struct Cache {
  struct Entry {
    IndexKey key;
    Value value;
  };
  std::mutex mutex;
  std::array<Entry, N> entries;
  size_t next = 0;

  // Round robin over the entries `keep` does not hold on to (none: not inserted).
  template <typename Keep = bool (*)(const Entry&)>
  void insert(const at::Tensor& index, Value value, Keep keep = [](const Entry&) { return false; }) {
    const std::lock_guard<std::mutex> lock(mutex);
    for (size_t tried = 0; tried < N; ++tried) {
      Entry& e = entries[next++ % N];
      if (keep(e)) continue;
      e = {IndexKey(index), std::move(value)};
      return;
    }
  }

  // The value of the first entry for index's current values that `accept` takes.
  template <typename Accept>
  std::optional<Value> find(const at::Tensor& index, Accept accept) {
    const std::lock_guard<std::mutex> lock(mutex);
    for (const auto& e : entries)
      if (accept(e.value) && e.key.matches(index)) return e.value;
    return std::nullopt;
  }
};

struct ValidIndex {
  int64_t bound = 0;
  bool sorted = false;
  bool offsets = false;  // a ptr checked against exactly `bound` rows, not an index
  int flags = 0;         // kLongSegment bits if sorted and found
};
// Room for a heterogeneous model's graphs: every edge type's index pair,
// transposed index and segment_matmul offsets. Forgotten entries cost a
// device->host sync per call each, a scan of the entries far less.
Cache<ValidIndex, 64>& valid_indices() {
  static Cache<ValidIndex, 64> cache;
  return cache;
}

struct CachedOffsets {
  int64_t S = 0;
  SegmentOffsets offsets;
  bool pinned = false;  // read by a captured CUDA graph
};
Cache<CachedOffsets, 8>& segment_offsets() {
  static Cache<CachedOffsets, 8> cache;
  return cache;
}

Cache<bool, 64>& static_indices() {
  static Cache<bool, 64> cache;
  return cache;
}

}  // namespace

bool index_cacheable(const at::Tensor& index) {
  return !index.is_inference() && index.has_storage() && index.numel() > 0;
}

int known_index_flags(const at::Tensor& index, int64_t bound, bool sorted) {
  if (!index_cacheable(index)) return -1;
  const auto found = valid_indices().find(
      index, [&](const ValidIndex& v) { return !v.offsets && v.bound <= bound && (v.sorted || !sorted); });
  return found ? found->flags : -1;
}

void remember_valid_index(const at::Tensor& index, int64_t bound, bool sorted, int flags) {
  if (index_cacheable(index)) valid_indices().insert(index, {bound, sorted, false, flags & kLongSegmentBits});
}

bool offsets_known_valid(const at::Tensor& ptr, int64_t total) {
  return index_cacheable(ptr) &&
         valid_indices().find(ptr, [&](const ValidIndex& v) { return v.offsets && v.bound == total; }).has_value();
}

void remember_valid_offsets(const at::Tensor& ptr, int64_t total) {
  if (index_cacheable(ptr)) valid_indices().insert(ptr, {total, true, true, 0});
}

void mark_static_index(const at::Tensor& index) {
  if (index_cacheable(index) && !is_static_index(index)) static_indices().insert(index, true);
}

bool is_static_index(const at::Tensor& index) {
  return index_cacheable(index) && static_indices().find(index, [](bool declared) { return declared; }).has_value();
}

std::optional<SegmentOffsets> cached_segment_offsets(const at::Tensor& index, int64_t S, bool pin) {
  if (!index_cacheable(index)) return std::nullopt;
  auto& cache = segment_offsets();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  std::optional<SegmentOffsets> found;
  for (auto& e : cache.entries) {
    if (e.key.expired() && e.value.offsets.ptr.defined()) e.value = {};  // the index is gone: free its offsets
    if (e.value.offsets.ptr.defined() && e.value.S == S && e.key.matches(index)) {
      e.value.pinned |= pin;
      found = e.value.offsets;
    }
  }
  return found;
}

void remember_segment_offsets(const at::Tensor& index, int64_t S, const SegmentOffsets& offsets) {
  if (!index_cacheable(index)) return;
  // Entries a captured graph reads stay while their index lives.
  segment_offsets().insert(index, {S, offsets, false}, [](const auto& e) { return e.value.pinned && !e.key.expired(); });
}

at::Tensor empty_outside_graph_pools(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const std::vector<int64_t> shape(sizes.begin(), sizes.end());
  return std::async(std::launch::async, [&] { return uninitialized(shape, options); }).get();
}

void clear_segment_offsets() {
  auto& cache = segment_offsets();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  for (auto& e : cache.entries)
    if (!e.value.pinned || e.key.expired()) e = {};
}

int64_t segment_offsets_cached() {
  auto& cache = segment_offsets();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  int64_t held = 0;
  for (const auto& e : cache.entries) held += e.value.offsets.ptr.defined() && !e.key.expired();
  return held;
}

}  // namespace geot
