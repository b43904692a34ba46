// Just enough of CUDA to run gen's kernels (src/model/device/kernels.cu) on the CPU, for
// tests/cuda_kernels.rs: every thread of a block is a real thread, __syncthreads is a barrier,
// warp shuffles go through shared memory between two barriers (the kernels call them from
// uniform control flow, as CUDA requires anyway). Blocks run one after another, so one static
// buffer serves as every block's shared memory.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <functional>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__

using std::min;

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

namespace emu {
inline thread_local dim3 thread_idx, block_idx;
inline dim3 block_dim, grid_dim;
inline std::barrier<>* bar = nullptr;
inline float shuffle[1024];
}  // namespace emu

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

// The kernels' `extern __shared__ float smem[];` names this.
float smem[1 << 16];

inline void __syncthreads() { emu::bar->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    const unsigned tid = threadIdx.x;
    emu::shuffle[tid] = v;
    __syncthreads();
    const float other = emu::shuffle[tid ^ lane_mask];
    __syncthreads();
    return other;
}

namespace emu {
// Run `kernel(args...)` over grid x block threads, one block at a time.
template <typename... Args>
void launch(dim3 grid, dim3 block, void (*kernel)(Args...), Args... args) {
    grid_dim = grid;
    block_dim = block;
    for (unsigned by = 0; by < grid.y; by++) {
        for (unsigned bx = 0; bx < grid.x; bx++) {
            std::barrier<> b(block.x);
            bar = &b;
            std::vector<std::thread> threads;
            for (unsigned t = 0; t < block.x; t++) {
                threads.emplace_back([=] {
                    thread_idx = dim3{t, 0, 0};
                    block_idx = dim3{bx, by, 0};
                    kernel(args...);
                });
            }
            for (auto& th : threads) th.join();
        }
    }
}
}  // namespace emu
