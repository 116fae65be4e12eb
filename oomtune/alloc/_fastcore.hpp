// The compiled replay core of the virtual GPU: CachingAllocatorSim's malloc/free in C++.
//
// A line-by-line port of the pure-Python simulator (oomtune/alloc/sim.py, _split.py, _segments.py,
// _release.py, _expandable.py), which itself reproduces DeviceCachingAllocator in
// c10/cuda/CUDACachingAllocator.cpp (torch 2.14.1). The Python simulator is the reference: every
// branch below names the Python method it mirrors, and tests/test_alloc_compiled.py checks that both
// give byte-identical replay results. Sizes and addresses are bytes (int64; the Python keys need
// them below 2**56). Stats use the flat layout of oomtune/alloc/_stats.py: st[type][3 * stat + k]
// with type 0 all / 1 small_pool / 2 large_pool and k 0 current / 1 peak / 2 freed.
//
// Free blocks of a pool live in a std::set ordered like BlockComparatorSize (stream, size, addr);
// unmapped expandable ranges in one ordered like BlockComparatorAddress (stream, addr). Blocks are
// structs in a vector, linked by index (-1 = none). What the port does not cover makes the core
// stop with status DECLINED (the caller then replays with the Python simulator): a negative size,
// running out of simulated address space, and expandable-segment states the Python code would
// reject with an exception.
//
// Keeping the two in step: a change to the Python simulator's behaviour must be ported here (the
// identity tests fail until it is); after editing this file or _fastcore.pyx, rebuild with
// `pip install -e .` (or `python setup.py build_ext --inplace`).
#pragma once
#include <cstdint>
#include <iterator>
#include <set>
#include <unordered_map>
#include <vector>

namespace oomcore {

typedef int64_t i64;

// A hash map from int64 keys to V with open addressing (linear probing; a removed key leaves a
// tombstone; the table is a power of two, rebuilt once live keys and tombstones fill half of it).
// For the address maps on the replay's hot path (live blocks by address, recorded -> simulated
// addresses): std::unordered_map allocates a node per insert. Any int64 is a key (the slot states
// are kept apart from the keys). Iteration order is the table's: callers must not depend on it.
template <class V>
struct AddrMap {
    std::vector<i64> keys;
    std::vector<V> vals;
    std::vector<unsigned char> state;   // 0 empty, 1 full, 2 tombstone
    size_t used = 0, live = 0;           // used = full + tombstones
    int shift = 60;

    AddrMap() { rebuild(16); }
    size_t slot(i64 k) const { return (size_t)(((uint64_t)k * 0x9E3779B97F4A7C15ULL) >> shift); }
    size_t size() const { return live; }
    void clear() { rebuild(16); }
    void reserve(size_t n) {   // room for n live keys without a rebuild
        size_t cap = keys.size();
        while (cap < 2 * n + 2) cap *= 2;
        if (cap != keys.size()) rebuild(cap);
    }
    void rebuild(size_t cap) {   // cap: a power of two >= 16
        std::vector<i64> ok;
        std::vector<V> ov;
        std::vector<unsigned char> os;
        ok.swap(keys);
        ov.swap(vals);
        os.swap(state);
        keys.assign(cap, 0);
        vals.assign(cap, V());
        state.assign(cap, 0);
        shift = 64;
        for (size_t c = cap; c > 1; c >>= 1) --shift;
        used = live = 0;
        for (size_t i = 0; i < os.size(); ++i)
            if (os[i] == 1) set(ok[i], ov[i]);
    }
    V* find(i64 k) {   // the value of k, or nullptr
        size_t m = keys.size() - 1;
        for (size_t i = slot(k);; i = (i + 1) & m) {
            if (state[i] == 0) return nullptr;
            if (state[i] == 1 && keys[i] == k) return &vals[i];
        }
    }
    void set(i64 k, V v) {   // map[k] = v
        size_t m = keys.size() - 1, tomb = SIZE_MAX, i = slot(k);
        for (;; i = (i + 1) & m) {
            if (state[i] == 0) break;
            if (state[i] == 1 && keys[i] == k) { vals[i] = v; return; }
            if (state[i] == 2 && tomb == SIZE_MAX) tomb = i;
        }
        if (tomb != SIZE_MAX) {
            i = tomb;
        } else {
            ++used;
        }
        keys[i] = k;
        vals[i] = v;
        state[i] = 1;
        ++live;
        if (2 * used > keys.size()) {
            size_t cap = 16;
            while (cap < 4 * live) cap *= 2;
            rebuild(cap);
        }
    }
    bool pop(i64 k, V& out) {   // remove k, its value in out; false when absent
        size_t m = keys.size() - 1;
        for (size_t i = slot(k);; i = (i + 1) & m) {
            if (state[i] == 0) return false;
            if (state[i] == 1 && keys[i] == k) {
                out = vals[i];
                state[i] = 2;
                --live;
                return true;
            }
        }
    }
    template <class F> void for_each(F f) const {
        for (size_t i = 0; i < keys.size(); ++i)
            if (state[i] == 1) f(keys[i], vals[i]);
    }
};

static const i64 K_MIN_BLOCK = 512, K_SMALL_SIZE = 1 << 20, K_SMALL_BUFFER = 2 << 20;
static const i64 K_MIN_LARGE_ALLOC = 10 << 20, K_ROUND_LARGE = 2 << 20, ALIGN = 2 << 20;
static const i64 ADDRESS_BASE = 0x7F0000000000LL, ADDRESS_END = (i64)1 << 56;
static const i64 UNLIMITED = INT64_MAX;   // max_split_size "unlimited" (SIZE_MAX in torch)
enum { OK = 0, OOM = 1, DECLINED = 2 };
// stat offsets (see _stats.py): current; +1 peak, +2 freed
enum { ALLOCATION = 0, SEGMENT = 3, INACTIVE_SPLIT = 9, ALLOCATED = 12, RESERVED = 15,
       INACTIVE_SPLIT_BYTES = 21, REQUESTED = 24, NSTAT3 = 27 };

struct Block {
    i64 addr, size, requested, stream, gc_base;
    int32_t prev, next, es;   // block indices (-1 none); es: expandable segment index or -1
    bool small, allocated, mapped;
};

struct Key { i64 stream, size, addr; int32_t id; };
struct KeyLess {
    bool operator()(const Key& a, const Key& b) const {
        if (a.stream != b.stream) return a.stream < b.stream;
        if (a.size != b.size) return a.size < b.size;
        return a.addr < b.addr;
    }
};
struct UKey { i64 stream, addr; int32_t id; };
struct UKeyLess {
    bool operator()(const UKey& a, const UKey& b) const {
        return a.stream != b.stream ? a.stream < b.stream : a.addr < b.addr;
    }
};
struct Seg { i64 base, page; };
// a segment event (CachingAllocatorSim.segment_events): action 0 segment_alloc, 1 segment_free,
// 2 segment_map, 3 segment_unmap; index = the malloc/free call that caused it
struct SegEvent { int action; i64 addr, size, stream, index; };
struct Pool {
    bool small;
    std::set<Key, KeyLess> blocks;        // free mapped blocks
    std::set<UKey, UKeyLess> unmapped;    // unmapped expandable ranges
    i64 gc_calls;
};

static inline void inc(i64* s, int i, i64 amount) {
    i64 c = s[i] + amount;
    s[i] = c;
    if (c > s[i + 1]) s[i + 1] = c;
}
static inline void dec(i64* s, int i, i64 amount) {
    s[i] -= amount;
    s[i + 2] += amount;
}
static inline int bit_length(i64 x) { return x ? 64 - __builtin_clzll((unsigned long long)x) : 0; }

class Core {
public:
    // settings as CachingAllocatorSim holds them (_max_split with UNLIMITED for SIZE_MAX, ...);
    // allowed < 0: no memory fraction set; divs: 16 entries or null (option off)
    i64 max_split, non_split, large_seg, total, non_alloc, allowed;
    double gc_threshold;
    bool gc_on, expandable, has_divs;
    i64 divs[16];
    i64 st[3][NSTAT3];
    i64 over_allocs[3], over_segs[3];
    i64 num_alloc_retries, num_ooms, num_sync_all_streams, num_device_alloc, num_device_free;
    i64 total_alloc, next_addr;
    int status;
    // the latest OOM (last_oom) and the first of a replay (oom): alloc_size, request size, free,
    // allocated, reserved (bytes)
    i64 oom_alloc_size, oom_orig, oom_free, oom_allocated, oom_reserved;
    i64 last_oom[5];
    // the per-call API (api_*): calls made so far, the current call's index, segment events
    i64 calls, index;
    bool record;
    std::vector<SegEvent> events;
    AddrMap<int32_t> active;   // addr -> allocated block
    Pool pools[2];   // 0 small, 1 large
    std::vector<Block> blocks;
    std::vector<int32_t> spare;   // indices of dead blocks for reuse
    std::vector<Seg> segs;

    Core() : max_split(UNLIMITED), non_split(20 << 20), large_seg(20 << 20), total(0), non_alloc(0),
             allowed(-1), gc_threshold(0.0), gc_on(false), expandable(false), has_divs(false),
             num_alloc_retries(0), num_ooms(0), num_sync_all_streams(0), num_device_alloc(0),
             num_device_free(0), total_alloc(0), next_addr(ADDRESS_BASE), status(OK),
             oom_alloc_size(0), oom_orig(0), oom_free(0), oom_allocated(0), oom_reserved(0),
             calls(0), index(0), record(false) {
        for (int i = 0; i < 5; ++i) last_oom[i] = 0;
        for (int t = 0; t < 3; ++t) {
            for (int i = 0; i < NSTAT3; ++i) st[t][i] = 0;
            over_allocs[t] = over_segs[t] = 0;
        }
        for (int i = 0; i < 16; ++i) divs[i] = 0;
        pools[0].small = true;
        pools[1].small = false;
        pools[0].gc_calls = pools[1].gc_calls = 0;
    }

    i64 stat(int t, int i) const { return st[t][i]; }
    void set_div(int i, i64 v) { divs[i] = v; }

    // -- blocks -----------------------------------------------------------------------------
    int32_t new_block(i64 addr, i64 size, i64 stream, bool small, int32_t prev, int32_t next,
                      i64 requested, int32_t es, i64 gc_base) {
        Block b = {addr, size, requested, stream, gc_base, prev, next, es, small, false, true};
        if (!spare.empty()) {
            int32_t id = spare.back();
            spare.pop_back();
            blocks[id] = b;
            return id;
        }
        blocks.push_back(b);
        return (int32_t)blocks.size() - 1;
    }
    Pool& pool_of(const Block& b) { return pools[b.small ? 0 : 1]; }
    void insert_free(int32_t id) {   // SegmentMixin._insert_free
        Block& b = blocks[id];
        Pool& p = pool_of(b);
        p.blocks.insert(Key{b.stream, b.size, b.addr, id});
        b.gc_base = p.gc_calls;
    }
    void remove_free(int32_t id) {   // ReleaseMixin._remove_free
        Block& b = blocks[id];
        pool_of(b).blocks.erase(Key{b.stream, b.size, b.addr, id});
    }
    void insert_unmapped(int32_t id) {
        Block& b = blocks[id];
        pool_of(b).unmapped.insert(UKey{b.stream, b.addr, id});
    }
    void remove_unmapped(int32_t id) {
        Block& b = blocks[id];
        pool_of(b).unmapped.erase(UKey{b.stream, b.addr, id});
    }
    i64 device_free() const { return total - non_alloc - total_alloc; }
    i64 reserve_address(i64 size, i64 align) {   // SegmentMixin._reserve_address
        i64 addr = (next_addr + align - 1) / align * align;
        next_addr = (addr + size + ALIGN - 1) / ALIGN * ALIGN;
        if (next_addr >= ADDRESS_END) status = DECLINED;   // Python raises ConfigError
        return addr;
    }

    // -- sizes (_blocks.round_size, get_allocation_size) ---------------------------------------
    i64 round_size(i64 size) const {
        if (size < K_MIN_BLOCK) return K_MIN_BLOCK;
        if (has_divs) {
            int i = bit_length(size) - 1 - 20;
            i = i < 0 ? 0 : (i > 15 ? 15 : i);
            i64 d = divs[i];
            if (d > 1 && size > K_MIN_BLOCK * d) {   // roundup_power2_next_division
                if ((size & (size - 1)) == 0) return size;
                i64 floor2 = (i64)1 << (bit_length(size) - 1);
                i64 step = floor2 >> (bit_length(d) - 1);
                if (step == 0) return floor2 << 1;
                i64 fl = size & ~(step - 1);
                return fl == size ? size : fl + step;
            }
        }
        return (size + K_MIN_BLOCK - 1) & -K_MIN_BLOCK;
    }
    i64 allocation_size(i64 size) const {
        if (size <= K_SMALL_SIZE) return K_SMALL_BUFFER;
        if (size < K_MIN_LARGE_ALLOC) return large_seg;
        return (size + K_ROUND_LARGE - 1) & -K_ROUND_LARGE;
    }

    // -- malloc (CachingAllocatorSim.malloc); returns a block index, -1 for 0 bytes, -2 on OOM ----
    int32_t malloc(i64 size_bytes, i64 stream) {
        i64 size;
        if (size_bytes < 512) {
            if (size_bytes <= 0) {
                if (size_bytes == 0) return -1;
                status = DECLINED;   // Python raises ConfigError
                return -2;
            }
            size = 512;
        } else if (!has_divs) {
            size = (size_bytes + 511) & -512;
        } else {
            size = round_size(size_bytes);
        }
        bool small = size <= 1048576;
        Pool& pool = pools[small ? 0 : 1];
        i64* lt = st[small ? 1 : 2];
        if (gc_on) pool.gc_calls += 1;
        int32_t id = -1;
        auto it = pool.blocks.lower_bound(Key{stream, size, 0, 0});   // get_free_block
        if (it != pool.blocks.end() && it->stream == stream) {
            if (expandable) it = pick_expandable(pool, it, stream);
            i64 bs = it->size, ms = max_split;
            if (ms == UNLIMITED || (size < ms ? bs < ms : bs < size + non_split)) {
                id = it->id;
                pool.blocks.erase(it);
            }
        }
        if (id < 0) {
            id = alloc_slow(size, stream, pool, small, size_bytes);
            if (id < 0) return -2;
        }
        Block* b = &blocks[id];
        i64 bsize = b->size;
        i64 remaining = bsize - size;   // should_split
        bool split = (small || expandable) ? remaining >= 512
                                           : (remaining > 1048576 && size < max_split);
        if (split) {
            b->size = bsize = size;
            int32_t nxt = b->next;
            int32_t rest = new_block(b->addr + size, remaining, stream, small, id, nxt, b->requested,
                                     b->es, pool.gc_calls);
            b = &blocks[id];   // the vector may have moved
            if (nxt >= 0) blocks[nxt].prev = rest;
            b->next = rest;
            pool.blocks.insert(Key{stream, remaining, b->addr + size, rest});
            if (b->es < 0) {
                if (nxt >= 0 || b->prev >= 0) {   // _shrink_inactive
                    for (i64* s : {st[0], lt}) dec(s, INACTIVE_SPLIT_BYTES, size);
                } else {                         // _new_inactive
                    for (i64* s : {st[0], lt}) {
                        inc(s, INACTIVE_SPLIT_BYTES, remaining);
                        inc(s, INACTIVE_SPLIT, 1);
                    }
                }
            }
        } else if ((b->prev >= 0 || b->next >= 0) && b->es < 0) {   // _activate_inactive
            for (i64* s : {st[0], lt}) {
                dec(s, INACTIVE_SPLIT_BYTES, bsize);
                dec(s, INACTIVE_SPLIT, 1);
            }
        }
        b->allocated = true;
        b->requested = size_bytes;
        for (i64* s : {st[0], lt}) {
            inc(s, ALLOCATION, 1);
            inc(s, ALLOCATED, bsize);
            inc(s, REQUESTED, size_bytes);
        }
        if (bsize >= max_split) inc(over_allocs, 0, 1);
        return id;
    }

    // -- free (CachingAllocatorSim.free + SplitMixin._free_split) ------------------------------
    void free(int32_t id) {
        Block& b = blocks[id];
        b.allocated = false;
        i64 size = b.size, req = b.requested;
        i64* lt = st[b.small ? 1 : 2];
        for (i64* s : {st[0], lt}) {
            dec(s, ALLOCATION, 1);
            dec(s, ALLOCATED, size);
            dec(s, REQUESTED, req);
        }
        if (size >= max_split) dec(over_allocs, 0, 1);
        int32_t prev = b.prev, nxt = b.next;
        if (prev < 0 && nxt < 0) {
            insert_free(id);
            return;
        }
        if (b.es >= 0) {   // ExpandableMixin._free_expandable
            if (prev >= 0 && !blocks[prev].allocated && blocks[prev].mapped) recycle(try_merge(id, prev));
            if (nxt >= 0 && !blocks[nxt].allocated && blocks[nxt].mapped) recycle(try_merge(id, nxt));
            insert_free(id);
            return;
        }
        Pool& pool = pool_of(b);
        i64 net_n = 0, net_b = 0;
        if (prev >= 0 && !blocks[prev].allocated) {
            Block& p = blocks[prev];
            pool.blocks.erase(Key{p.stream, p.size, p.addr, prev});
            b.addr = p.addr;
            b.prev = p.prev;
            if (p.prev >= 0) blocks[p.prev].next = id;
            b.size += p.size;
            net_n = -1;
            net_b = -p.size;
            spare.push_back(prev);
        }
        if (nxt >= 0 && !blocks[nxt].allocated) {
            Block& n = blocks[nxt];
            pool.blocks.erase(Key{n.stream, n.size, n.addr, nxt});
            b.next = n.next;
            if (n.next >= 0) blocks[n.next].prev = id;
            b.size += n.size;
            net_n -= 1;
            net_b -= n.size;
            spare.push_back(nxt);
        }
        pool.blocks.insert(Key{b.stream, b.size, b.addr, id});
        b.gc_base = pool.gc_calls;
        if (b.prev >= 0 || b.next >= 0) {
            net_n += 1;
            net_b += b.size;
        }
        for (i64* s : {st[0], lt}) {
            if (net_n > 0) inc(s, INACTIVE_SPLIT, net_n);
            else if (net_n < 0) dec(s, INACTIVE_SPLIT, -net_n);
            if (net_b > 0) inc(s, INACTIVE_SPLIT_BYTES, net_b);
            else if (net_b < 0) dec(s, INACTIVE_SPLIT_BYTES, -net_b);
        }
    }
    void recycle(int32_t id) { if (id >= 0) spare.push_back(id); }

    // -- SegmentMixin._alloc_slow / _alloc_block -----------------------------------------------
    int32_t alloc_slow(i64 size, i64 stream, Pool& pool, bool small, i64 orig) {
        i64 alloc_size = allocation_size(size);
        if (gc_on) garbage_collect();
        int32_t id = alloc_block(size, alloc_size, stream, pool, small, false);
        if (id < 0 && status == OK && release_available(size, stream, pool))
            id = alloc_block(size, alloc_size, stream, pool, small, false);
        if (id < 0 && status == OK) {
            release_cached();
            id = alloc_block(size, alloc_size, stream, pool, small, true);
        }
        if (status != OK) return -1;
        if (id < 0) {   // SegmentMixin._oom
            num_ooms += 1;
            last_oom[0] = alloc_size;
            last_oom[1] = orig;
            last_oom[2] = device_free();
            last_oom[3] = st[0][ALLOCATED];
            last_oom[4] = total_alloc;
        }
        return id;
    }
    int32_t alloc_block(i64 size, i64 alloc_size, i64 stream, Pool& pool, bool small, bool retry) {
        if (retry) num_alloc_retries += 1;
        if (allowed >= 0 && total_alloc + alloc_size > allowed) return -1;
        if (expandable) return try_allocate_expandable(stream, pool, size);
        if (alloc_size > device_free()) return -1;
        i64 addr = reserve_address(alloc_size, ALIGN);
        int32_t id = new_block(addr, alloc_size, stream, small, -1, -1, 0, -1, 0);
        total_alloc += alloc_size;
        for (i64* s : {st[0], st[small ? 1 : 2]}) {
            inc(s, SEGMENT, 1);
            inc(s, RESERVED, alloc_size);
        }
        if (alloc_size >= max_split) inc(over_segs, 0, 1);
        num_device_alloc += 1;
        if (record) events.push_back(SegEvent{0, addr, alloc_size, stream, index});
        return id;
    }

    // -- ReleaseMixin ------------------------------------------------------------------------
    void release_block(int32_t id) {
        remove_free(id);
        Block& b = blocks[id];
        i64 size = b.size;
        total_alloc -= size;
        for (i64* s : {st[0], st[b.small ? 1 : 2]}) {
            dec(s, SEGMENT, 1);
            dec(s, RESERVED, size);
        }
        if (size >= max_split) dec(over_segs, 0, 1);
        num_device_free += 1;
        if (record) events.push_back(SegEvent{1, b.addr, size, b.stream, index});
    }
    bool release_available(i64 size, i64 stream, Pool& pool) {
        i64 ms = max_split;
        if (ms == UNLIMITED) return false;
        i64 target = size >= ms ? size : ms;
        auto it = pool.blocks.lower_bound(Key{stream, target, 0, 0});
        if (it != pool.blocks.end() && it->stream == stream) {
            if (blocks[it->id].es >= 0) return false;
            release_block(it->id);
            return true;
        }
        if (it == pool.blocks.begin()) return false;
        i64 released = 0;
        auto j = std::prev(it);
        while (released < target) {
            if (j->size < ms || j->stream != stream) break;
            int32_t id = j->id;
            if (blocks[id].es >= 0) break;
            released += blocks[id].size;
            bool first = j == pool.blocks.begin();
            auto before = first ? j : std::prev(j);
            release_block(id);
            if (first) break;
            j = before;
        }
        return released >= target;
    }
    void release_cached() {
        num_sync_all_streams += 1;
        release_blocks(pools[1]);
        release_blocks(pools[0]);
    }
    void release_blocks(Pool& pool) {
        std::vector<Key> keys(pool.blocks.begin(), pool.blocks.end());
        std::vector<int32_t> to_unmap;
        for (const Key& k : keys) {
            const Block& b = blocks[k.id];
            if (b.es >= 0) to_unmap.push_back(k.id);
            else if (b.prev < 0 && b.next < 0) release_block(k.id);
        }
        for (int32_t id : to_unmap) {
            unmap_block(id);
            const Block& b = blocks[id];
            if (b.prev < 0 && b.next < 0 && !b.mapped) remove_unmapped(id);   // release_expandable_segment
        }
    }
    void garbage_collect() {
        i64 threshold = (i64)(gc_threshold * (double)allowed);
        if (total_alloc <= threshold) return;
        i64 target = total_alloc - threshold;
        Pool& large = pools[1];
        i64 calls = large.gc_calls;
        i64 total_age = 0, count = 0;
        for (const Key& k : large.blocks) {
            const Block& b = blocks[k.id];
            if (b.prev < 0 && b.next < 0 && b.es < 0) {
                total_age += calls - b.gc_base;
                count += 1;
            }
        }
        i64 reclaimed = 0;
        bool freed_any = true;
        while (reclaimed < target && freed_any && count > 0) {
            double age_threshold = (double)total_age / (double)count;
            freed_any = false;
            std::vector<Key> keys(large.blocks.begin(), large.blocks.end());
            for (const Key& k : keys) {
                if (!large.blocks.count(k)) continue;
                const Block& b = blocks[k.id];
                if (b.prev >= 0 || b.next >= 0 || b.es >= 0) continue;
                i64 age = calls - b.gc_base;
                if ((double)age >= age_threshold) {
                    freed_any = true;
                    reclaimed += b.size;
                    total_age -= age;
                    count -= 1;
                    release_block(k.id);
                }
            }
        }
    }

    // -- ExpandableMixin ---------------------------------------------------------------------
    // try_merge: absorb src into dst; returns src's index when merged (dead now), else -1
    int32_t try_merge(int32_t dst, int32_t src) {
        if (src < 0) return -1;
        Block& s = blocks[src];
        Block& d = blocks[dst];
        if (s.allocated || d.mapped != s.mapped) return -1;
        if (s.mapped) remove_free(src);
        else remove_unmapped(src);
        if (d.prev == src) {
            d.addr = s.addr;
            d.prev = s.prev;
            if (d.prev >= 0) blocks[d.prev].next = dst;
        } else {
            d.next = s.next;
            if (d.next >= 0) blocks[d.next].prev = dst;
        }
        d.size += s.size;
        return src;
    }
    void splice(int32_t id, int32_t before, int32_t after) {
        if (before >= 0) blocks[before].next = id;
        blocks[id].prev = before;
        if (after >= 0) blocks[after].prev = id;
        blocks[id].next = after;
    }
    std::set<Key, KeyLess>::iterator pick_expandable(Pool& pool, std::set<Key, KeyLess>::iterator it,
                                                     i64 stream) {
        while (true) {
            auto nit = std::next(it);
            if (nit == pool.blocks.end() || nit->stream != stream) break;
            const Block& cur = blocks[it->id];
            if (cur.es < 0) break;
            const Block& nx = blocks[nit->id];
            i64 grow_next = nx.size + (nx.next >= 0 && !blocks[nx.next].mapped ? blocks[nx.next].size : 0);
            i64 grow_cur = cur.size + (cur.next >= 0 && !blocks[cur.next].mapped ? blocks[cur.next].size : 0);
            if (grow_next >= grow_cur) break;
            it = nit;
        }
        return it;
    }
    int32_t find_expandable_block(i64 stream, Pool& pool, i64 size) {
        for (auto it = pool.unmapped.lower_bound(UKey{stream, INT64_MIN, 0});
             it != pool.unmapped.end() && it->stream == stream; ++it) {
            int32_t c = it->id;
            if (blocks[c].prev >= 0 && !blocks[blocks[c].prev].allocated) c = blocks[c].prev;
            i64 room = 0;
            int32_t b = c;
            while (room < size && b >= 0 && !blocks[b].allocated) {
                room += blocks[b].size;
                b = blocks[b].next;
            }
            if (room >= size) return c;
        }
        i64 page = pool.small ? K_SMALL_BUFFER : large_seg;
        i64 pages = (total + total / 8 + page - 1) / page;
        i64 base = reserve_address(pages * page, page);
        segs.push_back(Seg{base, page});
        int32_t cand = new_block(base, pages * page, stream, pool.small, -1, -1, 0,
                                 (int32_t)segs.size() - 1, 0);
        blocks[cand].mapped = false;
        insert_unmapped(cand);
        return cand;
    }
    bool map_block(int32_t to_map, i64 size) {
        const Seg& es = segs[blocks[to_map].es];
        i64 page = es.page, off = blocks[to_map].addr - es.base;
        i64 begin = off / page, end = (off + size + page - 1) / page;
        i64 mapped = (end - begin) * page;
        if (mapped == 0 || mapped > device_free()) return false;
        remove_unmapped(to_map);
        blocks[to_map].mapped = true;
        Block t = blocks[to_map];
        i64 start = t.addr;
        if (mapped < t.size) {
            int32_t rest = new_block(start + mapped, t.size - mapped, t.stream, t.small, -1, -1, 0, t.es, 0);
            blocks[rest].mapped = false;
            splice(rest, to_map, blocks[to_map].next);
            insert_unmapped(rest);
            blocks[to_map].size = mapped;
        }
        try_merge(to_map, blocks[to_map].prev);
        try_merge(to_map, blocks[to_map].next);
        insert_free(to_map);
        total_alloc += mapped;
        inc(st[0], RESERVED, mapped);
        inc(st[t.small ? 1 : 2], RESERVED, mapped);
        num_device_alloc += 1;
        if (record) events.push_back(SegEvent{2, start, mapped, t.stream, index});
        return true;
    }
    int32_t try_allocate_expandable(i64 stream, Pool& pool, i64 size) {
        int32_t cand = find_expandable_block(stream, pool, size);
        if (status != OK) return -1;
        if (!blocks[cand].mapped) {
            i64 s = blocks[cand].size < size ? blocks[cand].size : size;
            if (!map_block(cand, s)) return -1;
        }
        while (blocks[cand].size < size) {
            int32_t nxt = blocks[cand].next;
            if (nxt < 0 || blocks[nxt].mapped) {   // the Python code would fail here
                status = DECLINED;
                return -1;
            }
            i64 want = size - blocks[cand].size;
            if (!map_block(nxt, want < blocks[nxt].size ? want : blocks[nxt].size)) return -1;
            cand = nxt;
        }
        remove_free(cand);
        return cand;
    }
    void unmap_block(int32_t id) {
        Block b = blocks[id];
        const Seg& es = segs[b.es];
        i64 page = es.page, off = b.addr - es.base;
        i64 begin = (off + page - 1) / page, end = (off + b.size) / page;
        if (begin >= end) return;
        remove_free(id);
        i64 start = es.base + begin * page, length = (end - begin) * page;
        i64 before = start - b.addr;
        if (before > 0) {
            int32_t head = new_block(b.addr, before, b.stream, b.small, -1, -1, 0, b.es, 0);
            splice(head, blocks[id].prev, id);
            insert_free(head);
        }
        i64 after = b.size - before - length;
        if (after > 0) {
            int32_t tail = new_block(start + length, after, b.stream, b.small, -1, -1, 0, b.es, 0);
            splice(tail, id, blocks[id].next);
            insert_free(tail);
        }
        blocks[id].addr = start;
        blocks[id].size = length;
        blocks[id].mapped = false;
        try_merge(id, blocks[id].prev);
        try_merge(id, blocks[id].next);
        insert_unmapped(id);
        total_alloc -= length;
        dec(st[0], RESERVED, length);
        dec(st[b.small ? 1 : 2], RESERVED, length);
        num_device_free += 1;
        if (record) events.push_back(SegEvent{3, start, length, b.stream, index});
    }

    // -- the per-call API of CachingAllocatorSim (FastSim in _fastcore.pyx) ------------------
    // api_malloc: the block index; -1 for 0 bytes (address 0), -2 OOM, -3 negative size,
    // -4 declined (the simulated address space ran out)
    int32_t api_malloc(i64 size_bytes, i64 stream) {
        if (size_bytes <= 0) return size_bytes == 0 ? -1 : -3;
        index = calls;
        calls += 1;
        int32_t id = malloc(size_bytes, stream);
        if (status != OK) return -4;
        if (id >= 0) active.set(blocks[id].addr, id);
        return id;
    }
    // api_free: 0 done (or address 0), -1 not an allocated address
    int api_free(i64 addr) {
        int32_t id;
        if (!active.pop(addr, id)) return addr == 0 ? 0 : -1;
        calls += 1;
        free(id);
        return 0;
    }
    bool would_reuse_cached(i64 size_bytes, i64 stream) {   // CachingAllocatorSim.would_reuse_cached
        if (size_bytes <= 0) return false;
        i64 size = round_size(size_bytes);
        Pool& pool = pools[size <= 1048576 ? 0 : 1];
        auto it = pool.blocks.lower_bound(Key{stream, size, 0, 0});
        if (it == pool.blocks.end() || it->stream != stream) return false;
        if (expandable) it = pick_expandable(pool, it, stream);
        i64 bs = it->size, ms = max_split;
        return size < ms ? bs < ms : bs < size + non_split;
    }
    void empty_cache() {   // CachingAllocatorSim.empty_cache
        index = calls;
        release_cached();
    }
    void reset_peaks() {
        for (int t = 0; t < 3; ++t)
            for (int i = 0; i < NSTAT3; i += 3) st[t][i + 1] = st[t][i];
        over_allocs[1] = over_allocs[0];
        over_segs[1] = over_segs[0];
    }
    // every live block (free, allocated, unmapped) for memory_snapshot
    std::vector<int32_t> live_blocks() const {
        std::vector<int32_t> out;
        for (int p = 0; p < 2; ++p) {
            for (const Key& k : pools[p].blocks) out.push_back(k.id);
            for (const UKey& k : pools[p].unmapped) out.push_back(k.id);
        }
        active.for_each([&out](i64, int32_t id) { out.push_back(id); });
        return out;
    }

    // -- replay_stream's loop ----------------------------------------------------------------
    // Returns the number of events fed; *oom_index = index of the first OOM (-1 none).
    i64 replay(const signed char* actions, const long long* keys, const long long* sizes,
               const long long* streams, i64 n, bool stop_on_oom, i64* oom_index) {
        AddrMap<int32_t> live;
        live.reserve(1024);
        *oom_index = -1;
        for (i64 i = 0; i < n; ++i) {
            if (actions[i]) {
                int32_t id;
                if (live.pop(keys[i], id) && id >= 0) free(id);
            } else {
                int32_t id = malloc(sizes[i], streams[i]);
                if (status != OK) return i + 1;
                if (id == -2) {
                    if (*oom_index < 0) {
                        *oom_index = i;
                        oom_alloc_size = last_oom[0];
                        oom_orig = last_oom[1];
                        oom_free = last_oom[2];
                        oom_allocated = last_oom[3];
                        oom_reserved = last_oom[4];
                    }
                    if (stop_on_oom) return i + 1;
                    continue;
                }
                live.set(keys[i], id);
            }
        }
        return n;
    }
};

}  // namespace oomcore
