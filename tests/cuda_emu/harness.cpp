// gen's CUDA kernels (src/model/device/kernels.cu), run on the CPU through emu.h, against plain
// references. Built and run by tests/cuda_kernels.rs; prints one line per case and exits 1 on
// the first disagreement.
#include "emu.h"
#include "../../src/model/device/kernels.cu"

#include <cstdint>
#include <random>

static std::mt19937 rng(7);

static std::vector<float> randoms(size_t n, float lo = -1.f, float hi = 1.f) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    return v;
}

struct Step {
    unsigned q_row, end, lo;
    std::vector<unsigned> table;
};

// One case: `steps` one-token steps against a pool of `pool_blocks` blocks.
static bool attention_case(const char* name, int n_head, int kv_heads, int head_dim,
                           int pool_blocks, int n_rows, std::vector<Step> steps) {
    const int g = n_head / kv_heads;
    const size_t pool_rows = (size_t)kv_heads * pool_blocks * BS;
    auto q = randoms((size_t)n_rows * n_head * head_dim);
    // Keys scaled up so that the softmax is far from uniform.
    auto k = randoms(pool_rows * head_dim, -3.f, 3.f);
    auto v = randoms(pool_rows * head_dim);
    size_t stride = 3;
    for (auto& s : steps) stride = std::max(stride, 3 + s.table.size());
    std::vector<unsigned> meta(steps.size() * stride, 0);
    for (size_t i = 0; i < steps.size(); i++) {
        meta[i * stride] = steps[i].q_row;
        meta[i * stride + 1] = steps[i].end;
        meta[i * stride + 2] = steps[i].lo;
        std::copy(steps[i].table.begin(), steps[i].table.end(), meta.begin() + i * stride + 3);
    }
    std::vector<float> out(steps.size() * n_head * head_dim, NAN);
    const float scale = 1.f / std::sqrt((float)head_dim);
    const int warps = THREADS / 32;
    if ((size_t)(g * head_dim + g * THREADS + g * warps) > sizeof(smem) / sizeof(float)) return false;
    emu::launch(dim3{(unsigned)steps.size(), (unsigned)kv_heads, 1}, dim3{THREADS, 1, 1},
                gen_decode_attention_f32, (const float*)q.data(), (const float*)k.data(),
                (const float*)v.data(), (const unsigned*)meta.data(), out.data(), (int)stride,
                n_head, kv_heads, head_dim, pool_blocks, scale);
    double worst = 0;
    for (size_t i = 0; i < steps.size(); i++) {
        const Step& s = steps[i];
        for (int h = 0; h < n_head; h++) {
            const int j = h / g;
            const float* qh = &q[((size_t)s.q_row * n_head + h) * head_dim];
            std::vector<double> w;
            double mx = -INFINITY;
            for (unsigned p = s.lo; p < s.end; p++) {
                const size_t row = ((size_t)j * pool_blocks + s.table[p / BS]) * BS + p % BS;
                double d = 0;
                for (int e = 0; e < head_dim; e++) d += (double)qh[e] * k[row * head_dim + e];
                w.push_back(d * scale);
                mx = std::max(mx, w.back());
            }
            double sum = 0;
            for (auto& x : w) sum += (x = std::exp(x - mx));
            for (int e = 0; e < head_dim; e++) {
                double want = 0;
                for (unsigned p = s.lo; p < s.end; p++) {
                    const size_t row = ((size_t)j * pool_blocks + s.table[p / BS]) * BS + p % BS;
                    want += w[p - s.lo] / sum * v[row * head_dim + e];
                }
                const double got = out[(i * n_head + h) * head_dim + e];
                const double err = std::fabs(got - want);
                if (!(err <= 1e-4 + 1e-4 * std::fabs(want))) {
                    std::printf("%s: step %zu head %d value %d: kernel %.7f, reference %.7f\n", name,
                                i, h, e, got, want);
                    return false;
                }
                worst = std::max(worst, err);
            }
        }
    }
    std::printf("%s: %zu steps agree, largest difference %.2e\n", name, steps.size(), worst);
    return true;
}

// A block table of `blocks` entries drawn from the pool without repeats, out of order.
static std::vector<unsigned> table(int blocks, int pool_blocks, unsigned seed) {
    std::vector<unsigned> all(pool_blocks);
    for (int i = 0; i < pool_blocks; i++) all[i] = i;
    std::shuffle(all.begin(), all.end(), std::mt19937(seed));
    all.resize(blocks);
    return all;
}

static bool kv_write_case() {
    const int kv_heads = 3, head_dim = 64, pool_blocks = 8, n = 5;
    const long long k_stride = kv_heads * head_dim, v_stride = 9 * head_dim + 7;  // v: a wider view
    auto k = randoms((size_t)n * k_stride);
    auto v = randoms((size_t)n * v_stride);
    std::vector<unsigned> slots = {3 * BS + 0, 3 * BS + 1, 7 * BS + 15, 0, 5 * BS + 9};
    const size_t pool_rows = (size_t)kv_heads * pool_blocks * BS;
    std::vector<float> kp(pool_rows * head_dim, 0.f), vp(pool_rows * head_dim, 0.f);
    emu::launch(dim3{(unsigned)n, (unsigned)kv_heads, 1}, dim3{(unsigned)head_dim, 1, 1},
                gen_kv_write_f32, (const float*)k.data(), (const float*)v.data(), k_stride,
                v_stride, (const unsigned*)slots.data(), kp.data(), vp.data(), head_dim,
                pool_blocks);
    size_t written = 0;
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < kv_heads; j++) {
            const size_t row = ((size_t)j * pool_blocks + slots[i] / BS) * BS + slots[i] % BS;
            for (int e = 0; e < head_dim; e++) {
                if (kp[row * head_dim + e] != k[i * k_stride + j * head_dim + e] ||
                    vp[row * head_dim + e] != v[i * v_stride + j * head_dim + e]) {
                    std::printf("kv_write: token %d head %d value %d misplaced\n", i, j, e);
                    return false;
                }
                written++;
            }
        }
    }
    size_t nonzero = 0;
    for (size_t i = 0; i < kp.size(); i++) nonzero += kp[i] != 0.f;
    if (nonzero != written) {
        std::printf("kv_write: %zu values written, %zu expected\n", nonzero, written);
        return false;
    }
    std::printf("kv_write: %zu values in place, nothing else touched\n", written);
    return true;
}

int main() {
    bool ok = kv_write_case();
    // SmolLM2's shape: 9 heads over 3, width 64. Lengths within one tile, across tiles (256
    // keys a tile), a sliding window, and q rows out of order (steps beside a prompt chunk).
    ok = ok && attention_case("smollm2 shape", 9, 3, 64, 64, 7,
                              {{0, 1, 0, table(1, 64, 1)},
                               {3, 37, 0, table(3, 64, 2)},
                               {6, 600, 0, table(38, 64, 3)},
                               {2, 513, 100, table(33, 64, 4)},
                               {5, 257, 0, table(17, 64, 5)}});
    // Gemma 3 270M's: 4 heads over 1, width 256 (one group of 256 threads).
    ok = ok && attention_case("gemma3 shape", 4, 1, 256, 40, 3,
                              {{1, 300, 0, table(19, 40, 6)}, {2, 530, 18, table(34, 40, 7)}});
    // Width 96 (threads left over in the value pass), 14 heads over 2 (g = 7).
    ok = ok && attention_case("width 96, g 7", 14, 2, 96, 24, 2,
                              {{1, 200, 0, table(13, 24, 8)}, {0, 17, 0, table(2, 24, 9)}});
    return ok ? 0 : 1;
}
