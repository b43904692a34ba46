// gen's reference reader of llama.cpp: the logits llama.cpp computes for fixed token ids on a
// GGUF file, every position, written as little-endian f32 for tests/arch_suite.rs to compare
// with gen's. Built by .ci/llama-archs against the llama.cpp that .ci/llama-server builds.
//
//   llama-logits MODEL.gguf IDS OUT [N_CTX]
//     IDS: comma-separated token ids, one batch (causal, positions 0..n-1)
//     OUT: u32 n_tokens, u32 n_vocab, then n_tokens * n_vocab f32 (row per position)
//     N_CTX: the context size (default 256; it decides Phi-3's long or short rope factors)
//
// The cache holds f32 keys and values and flash attention is off, so what is compared is the
// architecture's arithmetic, not the cache's rounding. Exit 0 on success; 3 when llama.cpp
// refuses the file (its loader's own message on stderr); 1 on any other failure.
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf IDS OUT [N_CTX]\n", argv[0]);
        return 1;
    }
    std::vector<llama_token> ids;
    for (const char * p = argv[2]; *p;) {
        char * end = nullptr;
        long v = strtol(p, &end, 10);
        if (end == p) {
            fprintf(stderr, "llama-logits: bad id list %s\n", argv[2]);
            return 1;
        }
        ids.push_back((llama_token) v);
        p = *end == ',' ? end + 1 : end;
    }
    const uint32_t n_ctx = argc > 4 ? (uint32_t) atoi(argv[4]) : 256;
    llama_backend_init();
    llama_log_set([](ggml_log_level level, const char * text, void *) {
        if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
    }, nullptr);

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    // No extra buffer types (weight repacking): on a Xeon with AMX, llama.cpp 0c1e57098 moves
    // Q4_0/Q4_1/Q8_0/K-quant weights into its AMX buffer, whose product crashes (SIGSEGV in
    // ggml_backend_amx_mul_mat) on the suite's small models. Without them every machine computes
    // the reference with the same plain CPU kernels.
    mp.use_extra_bufts = false;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "llama-logits: llama.cpp refused %s\n", argv[1]);
        return 3;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx;
    cp.n_batch = cp.n_ubatch = (uint32_t) ids.size();
    cp.n_seq_max = 1;
    cp.n_threads = cp.n_threads_batch = 2;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "llama-logits: no context for %s\n", argv[1]);
        return 1;
    }
    llama_batch batch = llama_batch_init((int32_t) ids.size(), 0, 1);
    for (size_t i = 0; i < ids.size(); i++) {
        batch.token[i] = ids[i];
        batch.pos[i] = (llama_pos) i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = (int32_t) ids.size();
    if (llama_decode(ctx, batch) != 0) {
        fprintf(stderr, "llama-logits: decode failed on %s\n", argv[1]);
        return 1;
    }
    const uint32_t n_vocab = (uint32_t) llama_vocab_n_tokens(llama_model_get_vocab(model));
    const uint32_t n_tokens = (uint32_t) ids.size();
    std::string tmp = std::string(argv[3]) + ".partial";
    FILE * f = fopen(tmp.c_str(), "wb");
    if (!f) {
        fprintf(stderr, "llama-logits: cannot write %s\n", tmp.c_str());
        return 1;
    }
    fwrite(&n_tokens, 4, 1, f);
    fwrite(&n_vocab, 4, 1, f);
    for (uint32_t i = 0; i < n_tokens; i++) {
        fwrite(llama_get_logits_ith(ctx, (int32_t) i), 4, n_vocab, f);
    }
    if (fclose(f) != 0 || rename(tmp.c_str(), argv[3]) != 0) {
        fprintf(stderr, "llama-logits: cannot write %s\n", argv[3]);
        return 1;
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
