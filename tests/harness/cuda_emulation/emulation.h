/* Enough of CUDA's device runtime to run aggnet's kernel source on a CPU
 * (tests/unit/test_cuda_emulated.py): the built-ins the kernels use, with
 * the same results bit for bit on IEEE hosts, and a launch that runs
 * every thread of the grid. Threads that shuffle values within a warp run
 * as 32 host threads in lockstep (a barrier at each shuffle); the others
 * one after another. Not a GPU: no memory model, no timing; it checks what
 * the kernels compute and how they index, on any machine. */
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline

struct dim3 { unsigned int x = 1, y = 1, z = 1; };
struct uint4 { unsigned int x, y, z, w; };
struct uint2 { unsigned int x, y; };
inline uint4 make_uint4(unsigned int a, unsigned int b, unsigned int c, unsigned int d) { return {a, b, c, d}; }
inline uint2 make_uint2(unsigned int a, unsigned int b) { return {a, b}; }

namespace emu {
inline thread_local dim3 thread_index, block_index;
inline dim3 block_dim, grid_dim;
struct Warp {
    std::barrier<>* sync;
    unsigned int values[32];
};
inline thread_local Warp* warp = nullptr;
inline thread_local unsigned int lane = 0;
}  // namespace emu

#define threadIdx emu::thread_index
#define blockIdx emu::block_index
#define blockDim emu::block_dim
#define gridDim emu::grid_dim

template <class To, class From> inline To bits_as(From v) {
    static_assert(sizeof(To) == sizeof(From));
    To out;
    std::memcpy(&out, &v, sizeof out);
    return out;
}
inline double __longlong_as_double(long long v) { return bits_as<double>(v); }
inline long long __double_as_longlong(double d) { return bits_as<long long>(d); }
inline float __uint_as_float(unsigned int v) { return bits_as<float>(v); }
inline unsigned int __float_as_uint(float f) { return bits_as<unsigned int>(f); }
inline long long __double2ll_rn(double d) { return std::llrint(d); }  /* the default mode: nearest, ties to even */
inline float __double2float_rn(double d) { return static_cast<float>(d); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz(static_cast<unsigned int>(v)); }

inline unsigned int atomicMax(unsigned int* at, unsigned int v) {
    std::atomic_ref<unsigned int> a(*at);
    unsigned int old = a.load();
    while (old < v && !a.compare_exchange_weak(old, v)) {
    }
    return old;
}

inline unsigned int __shfl_down_sync(unsigned int mask, unsigned int v, int delta) {
    (void)mask;
    emu::Warp* w = emu::warp;
    if (w == nullptr) std::abort();  /* a kernel that shuffles must be launched in lockstep */
    w->values[emu::lane] = v;
    w->sync->arrive_and_wait();
    unsigned int out = emu::lane + delta < 32 ? w->values[emu::lane + delta] : v;
    w->sync->arrive_and_wait();
    return out;
}

namespace emu {
/* Every thread of a grid of `grid` blocks of `block` threads runs `body`;
 * `lockstep`: each warp's 32 threads at once, so that they can shuffle. */
template <class Body> void launch(unsigned int grid, unsigned int block, bool lockstep, Body body) {
    grid_dim = {grid, 1, 1};
    block_dim = {block, 1, 1};
    for (unsigned int b = 0; b < grid; ++b) {
        if (!lockstep) {
            for (unsigned int t = 0; t < block; ++t) {
                block_index = {b, 1, 1};
                thread_index = {t, 1, 1};
                body();
            }
            continue;
        }
        for (unsigned int first = 0; first < block; first += 32) {
            std::barrier<> sync(32);
            Warp w{&sync, {}};
            std::vector<std::thread> lanes;
            for (unsigned int l = 0; l < 32; ++l) {
                lanes.emplace_back([&, l] {
                    block_index = {b, 1, 1};
                    thread_index = {first + l, 1, 1};
                    warp = &w;
                    lane = l;
                    body();
                });
            }
            for (auto& t : lanes) t.join();
        }
    }
}
}  // namespace emu
