// gen's own CUDA kernels for the decode step, compiled to PTX by build.rs (feature `cuda`) and
// loaded through candle's CUDA device (src/model/cuda.rs). tests/cuda_kernels.rs compiles this
// file as C++ against a small emulation of CUDA (tests/cuda_emu) and checks both kernels on the
// CPU: keep to what the emulation offers (threadIdx/blockIdx/blockDim, __syncthreads,
// __shfl_xor_sync from uniform control flow, one `extern __shared__` float array).
//
// The paged KV cache: per layer, keys and values are (kv_heads * pool_blocks * BS, head_dim) f32
// rows; kv head j's rows for block b are at (j * pool_blocks + b) * BS. A sequence's position p
// lives in block table[p / BS], row p % BS.
//
// Both kernels replace several of candle's operations each: one launch where candle's path takes
// four (the cache write) or six to seven (attention: two gathers, two products, a scale, a
// mask, a softmax), and attention reads the cache where it is instead of gathering a padded copy.

#define BS 16
#define THREADS 256
#define WARPS (THREADS / 32)
#define MAX_G 16

// Write N tokens' keys and values into the cache. grid (N, kv_heads), block: threads over
// head_dim. k and v are rows of kv_heads * head_dim values, k_stride and v_stride apart (v is
// often a view of a wider q|k|v product).
extern "C" __global__ void gen_kv_write_f32(
    const float* __restrict__ k,
    const float* __restrict__ v,
    long long k_stride,
    long long v_stride,
    const unsigned int* __restrict__ slots,
    float* __restrict__ k_pool,
    float* __restrict__ v_pool,
    int head_dim,
    int pool_blocks)
{
    const int i = blockIdx.x;
    const int j = blockIdx.y;
    const unsigned int s = slots[i];
    const long long row = ((long long)j * pool_blocks + s / BS) * BS + s % BS;
    const float* ks = k + (long long)i * k_stride + (long long)j * head_dim;
    const float* vs = v + (long long)i * v_stride + (long long)j * head_dim;
    float* kd = k_pool + row * head_dim;
    float* vd = v_pool + row * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        kd[d] = ks[d];
        vd[d] = vs[d];
    }
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One query token per step against its sequence's cached keys and values, every step of a pass
// at once. grid (steps, kv_heads), block THREADS; one block serves the g = n_head / kv_heads
// query heads that share kv head j. meta, per step (meta_stride u32 apart): the row of q holding
// the step's token, the number of positions in the cache (the token's own included), the first
// position it may see (sliding windows), then its block table.
//
// Keys are taken THREADS at a time: each thread scores one key for all g heads, the block keeps
// a running maximum and sum per head (online softmax), and the values are accumulated by groups
// of head_dim threads, each thread one output value, each group a share of the keys; the groups
// are added at the end. Needs head_dim <= THREADS and g <= MAX_G (the caller checks).
//
// q: (N, n_head, head_dim); out: (steps, n_head * head_dim).
// Dynamic shared memory: (g * head_dim + g * THREADS + g * WARPS) floats.
extern "C" __global__ void gen_decode_attention_f32(
    const float* __restrict__ q,
    const float* __restrict__ k_pool,
    const float* __restrict__ v_pool,
    const unsigned int* __restrict__ meta,
    float* __restrict__ out,
    int meta_stride,
    int n_head,
    int kv_heads,
    int head_dim,
    int pool_blocks,
    float scale)
{
    extern __shared__ float smem[];
    const int b = blockIdx.x;
    const int j = blockIdx.y;
    const int tid = threadIdx.x;
    const int lane = tid % 32;
    const int warp = tid / 32;
    const int g = n_head / kv_heads;

    const unsigned int* m = meta + (long long)b * meta_stride;
    const long long q_row = m[0];
    const int end = (int)m[1];
    const int lo = (int)m[2];
    const unsigned int* table = m + 3;

    float* q_s = smem;                  // [g][head_dim]
    float* s = q_s + g * head_dim;      // [g][THREADS]: scores, then weights
    float* red = s + g * THREADS;       // [g][WARPS]

    const float* qb = q + (q_row * n_head + (long long)j * g) * head_dim;
    for (int e = tid; e < g * head_dim; e += THREADS) q_s[e] = qb[e];

    float mx[MAX_G], l[MAX_G], acc[MAX_G];
#pragma unroll
    for (int gi = 0; gi < MAX_G; gi++) {
        mx[gi] = -INFINITY;
        l[gi] = 0.f;
        acc[gi] = 0.f;
    }
    const int groups = THREADS / head_dim;
    const int grp = tid / head_dim;
    const int d = tid % head_dim;
    const long long head_base = (long long)j * pool_blocks;
    __syncthreads();

    for (int t0 = lo; t0 < end; t0 += THREADS) {
        const int p = t0 + tid;
        // Scores of this tile's keys, one per thread.
        float sc[MAX_G];
#pragma unroll
        for (int gi = 0; gi < MAX_G; gi++) sc[gi] = 0.f;
        if (p < end) {
            const unsigned int blk = table[p / BS];
            const float* kr = k_pool + ((head_base + blk) * BS + p % BS) * head_dim;
            for (int dd = 0; dd < head_dim; dd++) {
                const float kv = kr[dd];
#pragma unroll
                for (int gi = 0; gi < MAX_G; gi++)
                    if (gi < g) sc[gi] += q_s[gi * head_dim + dd] * kv;
            }
        }
#pragma unroll
        for (int gi = 0; gi < MAX_G; gi++) {
            if (gi < g) {
                const float v = p < end ? sc[gi] * scale : -INFINITY;
                sc[gi] = v;
                const float w = warp_max(v);
                if (lane == 0) red[gi * WARPS + warp] = w;
            }
        }
        __syncthreads();
        // New running maximum per head; this thread's weight; rescale what came before.
        float alpha[MAX_G];
#pragma unroll
        for (int gi = 0; gi < MAX_G; gi++) {
            alpha[gi] = 1.f;
            if (gi < g) {
                float tmax = red[gi * WARPS];
                for (int w = 1; w < WARPS; w++) tmax = fmaxf(tmax, red[gi * WARPS + w]);
                const float mnew = fmaxf(mx[gi], tmax);
                alpha[gi] = expf(mx[gi] - mnew); // 0 on the first tile (mx = -inf)
                mx[gi] = mnew;
                sc[gi] = p < end ? expf(sc[gi] - mnew) : 0.f;
            }
        }
        __syncthreads(); // every thread has read red
#pragma unroll
        for (int gi = 0; gi < MAX_G; gi++) {
            if (gi < g) {
                s[gi * THREADS + tid] = sc[gi];
                const float w = warp_sum(sc[gi]);
                if (lane == 0) red[gi * WARPS + warp] = w;
            }
        }
        __syncthreads();
#pragma unroll
        for (int gi = 0; gi < MAX_G; gi++) {
            if (gi < g) {
                float tsum = 0.f;
                for (int w = 0; w < WARPS; w++) tsum += red[gi * WARPS + w];
                l[gi] = l[gi] * alpha[gi] + tsum;
                acc[gi] *= alpha[gi];
            }
        }
        // Values: group grp takes keys grp, grp + groups, ... of the tile.
        if (grp < groups) {
            const int nt = min(THREADS, end - t0);
#pragma unroll 4
            for (int t = grp; t < nt; t += groups) {
                const int pp = t0 + t;
                const unsigned int blk = table[pp / BS];
                const float vv = v_pool[((head_base + blk) * BS + pp % BS) * head_dim + d];
#pragma unroll
                for (int gi = 0; gi < MAX_G; gi++)
                    if (gi < g) acc[gi] += s[gi * THREADS + t] * vv;
            }
        }
        __syncthreads(); // before the next tile overwrites s and red
    }

    // Add the groups' shares: part[grp][gi][d] in the scores' space (groups * head_dim <= THREADS).
    if (grp < groups) {
#pragma unroll
        for (int gi = 0; gi < MAX_G; gi++)
            if (gi < g) s[(grp * g + gi) * head_dim + d] = acc[gi];
    }
    __syncthreads();
    if (tid < head_dim) {
        float* ob = out + ((long long)b * n_head + (long long)j * g) * head_dim;
#pragma unroll
        for (int gi = 0; gi < MAX_G; gi++) {
            if (gi < g) {
                float total = 0.f;
                for (int gr = 0; gr < groups; gr++) total += s[(gr * g + gi) * head_dim + tid];
                ob[gi * head_dim + tid] = total / l[gi];
            }
        }
    }
}
