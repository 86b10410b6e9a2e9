// The GPU engine's kernels, in the subset of CUDA C that both NVRTC and the CPU emulator
// (gpu/emulator.h, used by the tests) compile: no headers, no warp intrinsics, no atomics,
// static shared memory only, every block size a power of two. Each kernel takes one struct
// of arguments whose layout matches a #[repr(C)] struct in gpu/kernels.rs (pointers first,
// then 4-byte fields); `KERNEL` declares it for the device or for the emulator.
//
// Layouts: rows are tokens, sequences packed one after another; `starts[s]` / `lens[s]`
// give sequence s's first row and its length. States are packed per sequence: the SSM
// state (H, P, N), the conv tail (C, K-1) oldest first, the log-decay (H).

#ifndef KERNEL
#define KERNEL(name, Args) extern "C" __global__ void name(const Args a)
#endif

typedef unsigned short bf16;

__device__ __forceinline__ float bf16_to_f32(bf16 v) { return __uint_as_float(((unsigned int)v) << 16); }

// Round to nearest even (NaN kept a NaN), as the CPU engine and PyTorch convert.
__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Loads element i of a matrix stored as f32 (is_bf16 = 0) or bf16.
__device__ __forceinline__ float load(const void* p, long long i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const bf16*)p)[i]) : ((const float*)p)[i];
}

__device__ __forceinline__ void store(void* p, long long i, float v, int is_bf16) {
    if (is_bf16) ((bf16*)p)[i] = f32_to_bf16(v);
    else ((float*)p)[i] = v;
}

struct Add {
    template <typename T> __device__ T operator()(T a, T b) const { return a + b; }
};
struct Max {
    __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// `op` of `v` over the block (blockDim.x a power of two ≤ 256), as a tree; every thread gets it.
template <typename T, typename Op> __device__ T block_reduce(T v, Op op) {
    __shared__ T scratch[256];
    int t = threadIdx.x;
    scratch[t] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) scratch[t] = op(scratch[t], scratch[t + s]);
        __syncthreads();
    }
    T r = scratch[0];
    __syncthreads();
    return r;
}

__device__ float block_sum(float v) { return block_reduce(v, Add()); }
__device__ float block_max(float v) { return block_reduce(v, Max()); }

// ---------------------------------------------------------------------------------------
// Tokens in and out.

struct EmbedArgs {
    const void* table;  // (vocab, d), f32 or bf16
    const int* ids;     // (rows)
    float* out;         // (rows, d)
    int d;
    int table_bf16;
};

// grid (rows), block 256.
KERNEL(embed, EmbedArgs) {
    long long row = blockIdx.x;
    long long src = (long long)a.ids[row] * a.d;
    for (int i = threadIdx.x; i < a.d; i += blockDim.x) a.out[row * a.d + i] = load(a.table, src + i, a.table_bf16);
}

struct RmsnormArgs {
    const float* x;   // (rows, d)
    const float* w;   // (d)
    void* out;        // (rows, d), f32 or bf16
    int d;
    int out_bf16;
    float eps;
    int pad;
};

// out = x / sqrt(mean(x²) + eps) · w. grid (rows), block 256.
KERNEL(rmsnorm, RmsnormArgs) {
    long long row = blockIdx.x;
    const float* x = a.x + row * a.d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < a.d; i += blockDim.x) ss += x[i] * x[i];
    ss = block_sum(ss);
    float scale = 1.0f / sqrtf(ss / (float)a.d + a.eps);
    for (int i = threadIdx.x; i < a.d; i += blockDim.x) store(a.out, row * a.d + i, x[i] * scale * a.w[i], a.out_bf16);
}

struct ConvertArgs {
    const float* x;
    void* out;
    long long n;
    int out_bf16;
    int pad;
};

// grid (ceil(n / 256)), block 256.
KERNEL(convert, ConvertArgs) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < a.n) store(a.out, i, a.x[i], a.out_bf16);
}

struct AddBiasArgs {
    float* x;        // (rows, cols)
    const float* b;  // (cols)
    int cols;
    int pad;
};

// grid (rows), block 256.
KERNEL(add_bias, AddBiasArgs) {
    long long row = blockIdx.x;
    for (int i = threadIdx.x; i < a.cols; i += blockDim.x) a.x[row * a.cols + i] += a.b[i];
}

struct LogprobArgs {
    const float* logits;  // (rows, vocab)
    const int* targets;   // (rows)
    float* out;           // (rows)
    int vocab;
    int pad;
};

// log p(target) of each row: grid (rows), block 256.
KERNEL(logprob_at, LogprobArgs) {
    long long row = blockIdx.x;
    const float* l = a.logits + row * a.vocab;
    float m = -3.402823466e38f;
    for (int i = threadIdx.x; i < a.vocab; i += blockDim.x) m = fmaxf(m, l[i]);
    m = block_max(m);
    float s = 0.0f;
    for (int i = threadIdx.x; i < a.vocab; i += blockDim.x) s += expf(l[i] - m);
    s = block_sum(s);
    if (threadIdx.x == 0) a.out[row] = l[a.targets[row]] - m - logf(s);
}

// ---------------------------------------------------------------------------------------
// The Mamba-2 mixer's stateful part.

struct ConvArgs {
    const float* zx;     // in_proj output (rows, width); the conv input starts at column `offset`
    float* tails;        // (seqs, C, K-1): conv_silu reads them, conv_tail then writes the
                         // new ones; conv_step does both
    const float* w;      // (C, K)
    const float* bias;   // (C)
    float* out;          // (rows, C): SiLU(conv)
    const int* starts;
    const int* lens;
    int width;
    int offset;
    int channels;
    int k;
};

// Depthwise causal conv over [tail; x], then SiLU. grid (ceil(max_len · C / 256), seqs), block 256.
KERNEL(conv_silu, ConvArgs) {
    int s = blockIdx.y;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int len = a.lens[s], c = (int)(i % a.channels), t = (int)(i / a.channels);
    if (t >= len) return;
    int kt = a.k - 1;
    const float* tail = a.tails + ((long long)s * a.channels + c) * kt;
    long long row0 = a.starts[s];
    float acc = a.bias[c];
    for (int j = 0; j < a.k; ++j) {
        int src = t + j - kt;  // position in the sequence; negative: the tail
        float v = src < 0 ? tail[kt + src] : a.zx[(row0 + src) * a.width + a.offset + c];
        acc += a.w[c * a.k + j] * v;
    }
    a.out[(row0 + t) * a.channels + c] = silu(acc);
}

// The tails after each sequence: its last K-1 conv inputs (conv_silu's arguments; w, bias and
// out unused). One thread per (sequence, channel) reads the old tail before writing. grid (ceil(C / 256), seqs), block 256.
KERNEL(conv_tail, ConvArgs) {
    int s = blockIdx.y;
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= a.channels) return;
    int kt = a.k - 1, len = a.lens[s];
    float* tail = a.tails + ((long long)s * a.channels + c) * kt;
    float old[16];
    for (int j = 0; j < kt; ++j) old[j] = tail[j];
    long long row0 = a.starts[s];
    for (int j = 0; j < kt; ++j) {
        int src = len - kt + j;
        tail[j] = src < 0 ? old[kt + src] : a.zx[(row0 + src) * a.width + a.offset + c];
    }
}

// The conv of short sequences (decode steps): one thread per (sequence, channel) walks the
// sequence with the window in registers, writing SiLU(conv) and then the new tail — the work of
// conv_silu and conv_tail in one launch. grid (ceil(C / 256), seqs), block 256; K ≤ 17.
KERNEL(conv_step, ConvArgs) {
    int s = blockIdx.y;
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= a.channels) return;
    int kt = a.k - 1, len = a.lens[s];
    float* tail = a.tails + ((long long)s * a.channels + c) * kt;
    float win[17];
    for (int j = 0; j < kt; ++j) win[j] = tail[j];
    long long row0 = a.starts[s];
    for (int t = 0; t < len; ++t) {
        win[kt] = a.zx[(row0 + t) * a.width + a.offset + c];
        float acc = a.bias[c];
        for (int j = 0; j < a.k; ++j) acc += a.w[c * a.k + j] * win[j];
        a.out[(row0 + t) * a.channels + c] = silu(acc);
        for (int j = 0; j < kt; ++j) win[j] = win[j + 1];
    }
    for (int j = 0; j < kt; ++j) tail[j] = win[j];
}

struct DtArgs {
    const float* zx;       // in_proj output; dt_raw at column `offset` + h
    const float* dt_bias;  // (H)
    const float* a_neg;    // A = -exp(A_log), (H)
    float* dt;             // (rows, H): clamp(softplus(dt_raw + dt_bias), lo, hi)
    float* log_decay;      // (seqs, H): += Σ dt·A over the sequence
    const int* starts;
    const int* lens;
    int width;
    int offset;
    int heads;
    float lo;
    float hi;
    int rows;
};

// dt of every (row, head). grid (ceil(rows · H / 256)), block 256.
KERNEL(dt_values, DtArgs) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)a.rows * a.heads) return;
    long long row = i / a.heads;
    int h = (int)(i % a.heads);
    float v = softplus(a.zx[row * a.width + a.offset + h] + a.dt_bias[h]);
    a.dt[i] = fminf(fmaxf(v, a.lo), a.hi);
}

// log_decay[s][h] += Σ_t dt·A over sequence s, each product rounded to f32 and summed in f64
// as the CPU engine sums it. grid (H, seqs), block 256.
KERNEL(log_decay_sum, DtArgs) {
    int h = blockIdx.x, s = blockIdx.y;
    long long row0 = a.starts[s];
    float A = a.a_neg[h];
    double acc = 0.0;
    for (int t = threadIdx.x; t < a.lens[s]; t += blockDim.x) acc += (double)(a.dt[(row0 + t) * a.heads + h] * A);
    acc = block_reduce(acc, Add());
    if (threadIdx.x == 0) {
        float* ld = a.log_decay + (long long)s * a.heads + h;
        *ld = (float)((double)*ld + acc);
    }
}

// Where one head's inputs sit in a row of the conv output (x | B | C).
struct ScanShape {
    int heads;     // H
    int headdim;   // P
    int d_state;   // N
    int groups;    // G
    int conv_dim;  // row stride of xbc: H·P + 2·G·N
    int pad;
};

__device__ __forceinline__ int x_col(const ScanShape& s, int h, int p) { return h * s.headdim + p; }
__device__ __forceinline__ int b_col(const ScanShape& s, int h, int n) {
    return s.heads * s.headdim + (h / (s.heads / s.groups)) * s.d_state + n;
}
__device__ __forceinline__ int c_col(const ScanShape& s, int h, int n) {
    return s.heads * s.headdim + s.groups * s.d_state + (h / (s.heads / s.groups)) * s.d_state + n;
}

struct ScanArgs {
    const float* xbc;        // (rows, conv_dim)
    const float* zx;         // in_proj output: dt_raw at column dt_offset + h
    const float* dt_bias;    // (H)
    const float* a_neg;      // (H)
    const float* d;          // (H)
    float* ssm;              // (seqs, H, P, N), updated in place
    float* log_decay;        // (seqs, H): += Σ dt·A, summed in f64 as the CPU engine sums it
    float* y;                // (rows, H·P)
    const int* starts;
    const int* lens;
    ScanShape shape;
    int width;
    int dt_offset;
    float lo;
    float hi;
    int threads_per_row;  // blockDim.x / P: the threads that share one p
    int pad;
};

// The recurrence token by token, for decode steps and short prompts: dt = clamp(softplus(
// dt_raw + dt_bias)) (the work of dt_values and log_decay_sum, done here so a decode step
// launches two kernels less), S = exp(dt·A)·S + dt·x·Bᵀ, y = S·C + D·x. One block per (head, sequence); thread
// (p, r) owns the state entries (p, n) with n ≡ r (mod threads_per_row).
// grid (H, seqs), block P · threads_per_row.
KERNEL(scan_steps, ScanArgs) {
    __shared__ float part[1024];
    __shared__ float dt_shared;
    int h = blockIdx.x, s = blockIdx.y;
    const ScanShape sh = a.shape;
    int tpr = a.threads_per_row;
    int p = threadIdx.x / tpr, r = threadIdx.x % tpr;
    float* S = a.ssm + (((long long)s * sh.heads + h) * sh.headdim + p) * sh.d_state;
    long long row0 = a.starts[s];
    float A = a.a_neg[h], D = a.d[h];
    double decay_sum = 0.0;
    for (int t = 0; t < a.lens[s]; ++t) {
        long long row = row0 + t;
        if (threadIdx.x == 0) {
            float v = softplus(a.zx[row * a.width + a.dt_offset + h] + a.dt_bias[h]);
            v = fminf(fmaxf(v, a.lo), a.hi);
            dt_shared = v;
            decay_sum += (double)(v * A);
        }
        __syncthreads();
        const float* in = a.xbc + row * sh.conv_dim;
        float dt = dt_shared;
        float decay = expf(dt * A);
        float x = in[x_col(sh, h, p)];
        float dx = dt * x;
        float acc = 0.0f;
        for (int n = r; n < sh.d_state; n += tpr) {
            float v = S[n] * decay + dx * in[b_col(sh, h, n)];
            S[n] = v;
            acc += v * in[c_col(sh, h, n)];
        }
        part[threadIdx.x] = acc;
        __syncthreads();
        if (r == 0) {
            float sum = 0.0f;
            for (int j = 0; j < tpr; ++j) sum += part[threadIdx.x + j];
            a.y[row * (sh.heads * sh.headdim) + h * sh.headdim + p] = sum + D * x;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float* ld = a.log_decay + (long long)s * sh.heads + h;
        *ld = (float)((double)*ld + decay_sum);
    }
}

// The chunked form (state-space duality) for prompts: chunks of L ≤ 64 tokens.
//   ChunkState: each chunk's own contribution to the state, as if it started from zero:
//               S_c = Σ_τ exp(cs_last − cs_τ)·dt_τ·x_τ·B_τᵀ
//   StatePass:  the state entering each chunk, in order: S_in(c+1) = exp(cs_last(c))·S_in(c) + S_c,
//               starting from the sequence's state, which ends as the state after the last chunk
//   ChunkScan:  y_t = Σ_{τ≤t} exp(cs_t − cs_τ)·(C_t·B_τ)·dt_τ·x_τ + exp(cs_t)·S_in·C_t + D·x_t
// where cs is the running sum of dt·A inside the chunk (cs_t includes t).
struct ChunkArgs {
    const float* xbc;    // (rows, conv_dim)
    const float* dt;     // (rows, H)
    const float* a_neg;  // (H)
    const float* d;      // (H)
    float* ssm;          // (seqs, H, P, N)
    float* chunks;       // (seqs, max_chunks, H, P, N): each chunk's state, then the state entering it
    float* y;            // (rows, H·P)
    const int* starts;
    const int* lens;
    ScanShape shape;
    int chunk;       // L ≤ 64
    int max_chunks;
};

// Loads a chunk's dt and the running sum of dt·A (cs) into shared memory; returns its length.
__device__ int chunk_decays(const ChunkArgs& a, int s, int c, int h, float* dt, float* cs) {
    int len = a.lens[s] - c * a.chunk;
    if (len > a.chunk) len = a.chunk;
    long long row0 = a.starts[s] + (long long)c * a.chunk;
    for (int t = threadIdx.x; t < len; t += blockDim.x) dt[t] = a.dt[(row0 + t) * a.shape.heads + h];
    __syncthreads();
    if (threadIdx.x == 0) {
        float run = 0.0f, A = a.a_neg[h];
        for (int t = 0; t < len; ++t) {
            run += dt[t] * A;
            cs[t] = run;
        }
    }
    __syncthreads();
    return len;
}

__device__ __forceinline__ float* chunk_state(const ChunkArgs& a, int s, int c, int h) {
    const ScanShape& sh = a.shape;
    return a.chunks + ((((long long)s * a.max_chunks + c) * sh.heads + h) * sh.headdim) * sh.d_state;
}

// grid (max_chunks, H, seqs), block 256.
KERNEL(ssd_chunk_state, ChunkArgs) {
    __shared__ float dt[64];
    __shared__ float cs[64];
    __shared__ float scale[64];  // exp(cs_last − cs_t)·dt_t, once per token
    int c = blockIdx.x, h = blockIdx.y, s = blockIdx.z;
    if (c * a.chunk >= a.lens[s]) return;
    int len = chunk_decays(a, s, c, h, dt, cs);
    for (int t = threadIdx.x; t < len; t += blockDim.x) scale[t] = expf(cs[len - 1] - cs[t]) * dt[t];
    __syncthreads();
    const ScanShape sh = a.shape;
    long long row0 = a.starts[s] + (long long)c * a.chunk;
    float* out = chunk_state(a, s, c, h);
    for (int e = threadIdx.x; e < sh.headdim * sh.d_state; e += blockDim.x) {
        int p = e / sh.d_state, n = e % sh.d_state;
        float acc = 0.0f;
        for (int t = 0; t < len; ++t) {
            const float* in = a.xbc + (row0 + t) * sh.conv_dim;
            acc += scale[t] * in[x_col(sh, h, p)] * in[b_col(sh, h, n)];
        }
        out[e] = acc;
    }
}

// grid (H, seqs), block 256.
KERNEL(ssd_state_pass, ChunkArgs) {
    __shared__ float total;
    int h = blockIdx.x, s = blockIdx.y;
    const ScanShape sh = a.shape;
    int nchunks = (a.lens[s] + a.chunk - 1) / a.chunk;
    long long row0 = a.starts[s];
    float* S = a.ssm + ((long long)s * sh.heads + h) * sh.headdim * sh.d_state;
    for (int c = 0; c < nchunks; ++c) {
        if (threadIdx.x == 0) {  // the chunk's Σ dt·A, summed in chunk_decays' order
            int end = (c + 1) * a.chunk < a.lens[s] ? (c + 1) * a.chunk : a.lens[s];
            float run = 0.0f, A = a.a_neg[h];
            for (int t = c * a.chunk; t < end; ++t) run += a.dt[(row0 + t) * sh.heads + h] * A;
            total = run;
        }
        __syncthreads();
        float decay = expf(total);
        float* slot = chunk_state(a, s, c, h);
        for (int e = threadIdx.x; e < sh.headdim * sh.d_state; e += blockDim.x) {
            float own = slot[e];
            slot[e] = S[e];  // the state entering chunk c
            S[e] = decay * S[e] + own;
        }
        __syncthreads();
    }
}

// grid (max_chunks, H, seqs), block 256.
KERNEL(ssd_chunk_scan, ChunkArgs) {
    __shared__ float dt[64];
    __shared__ float cs[64];
    __shared__ float cb[64 * 64];
    int c = blockIdx.x, h = blockIdx.y, s = blockIdx.z;
    if (c * a.chunk >= a.lens[s]) return;
    int len = chunk_decays(a, s, c, h, dt, cs);
    const ScanShape sh = a.shape;
    long long row0 = a.starts[s] + (long long)c * a.chunk;
    // The chunk's mixing matrix M[t][u] = exp(cs_t − cs_u)·(C_t·B_u)·dt_u for u ≤ t, once.
    for (int e = threadIdx.x; e < len * len; e += blockDim.x) {
        int t = e / len, u = e % len;
        float v = 0.0f;
        if (u <= t) {
            const float* ct = a.xbc + (row0 + t) * sh.conv_dim;
            const float* bu = a.xbc + (row0 + u) * sh.conv_dim;
            for (int n = 0; n < sh.d_state; ++n) v += ct[c_col(sh, h, n)] * bu[b_col(sh, h, n)];
            v *= expf(cs[t] - cs[u]) * dt[u];
        }
        cb[t * 64 + u] = v;
    }
    __syncthreads();
    const float* S = chunk_state(a, s, c, h);
    float D = a.d[h];
    for (int e = threadIdx.x; e < len * sh.headdim; e += blockDim.x) {
        int t = e / sh.headdim, p = e % sh.headdim;
        const float* in = a.xbc + (row0 + t) * sh.conv_dim;
        float from_state = 0.0f;
        for (int n = 0; n < sh.d_state; ++n) from_state += S[p * sh.d_state + n] * in[c_col(sh, h, n)];
        float acc = expf(cs[t]) * from_state;
        for (int u = 0; u <= t; ++u) acc += cb[t * 64 + u] * a.xbc[(row0 + u) * sh.conv_dim + x_col(sh, h, p)];
        a.y[(row0 + t) * (sh.heads * sh.headdim) + h * sh.headdim + p] = acc + D * in[x_col(sh, h, p)];
    }
}

struct GatedNormArgs {
    const float* y;   // (rows, d_inner)
    const float* zx;  // in_proj output: z in columns [0, d_inner)
    const float* w;   // (d_inner)
    void* out;        // (rows, d_inner), f32 or bf16
    int width;
    int d_inner;
    int group;
    int out_bf16;
    float eps;
    int mode;
};

// The mixer's gate and norm, by `mode`: 0, v = y·silu(z) and out = v / sqrt(mean_group(v²) +
// eps)·w (Mamba-2's); 1, out = y / sqrt(mean_group(y²) + eps)·w·silu(z) (the norm before the
// gate); 2, out = y·silu(z) (no norm; `w` unread). grid (rows, d_inner / group), block 256.
KERNEL(gated_rmsnorm, GatedNormArgs) {
    long long row = blockIdx.x;
    int g0 = blockIdx.y * a.group;
    const float* y = a.y + row * a.d_inner + g0;
    const float* z = a.zx + row * a.width + g0;
    float scale = 1.0f;
    if (a.mode != 2) {
        float ss = 0.0f;
        for (int i = threadIdx.x; i < a.group; i += blockDim.x) {
            float v = a.mode == 0 ? y[i] * silu(z[i]) : y[i];
            ss += v * v;
        }
        ss = block_sum(ss);
        scale = 1.0f / sqrtf(ss / (float)a.group + a.eps);
    }
    for (int i = threadIdx.x; i < a.group; i += blockDim.x) {
        float v;
        if (a.mode == 0) v = y[i] * silu(z[i]) * scale * a.w[g0 + i];
        else if (a.mode == 1) v = y[i] * scale * a.w[g0 + i] * silu(z[i]);
        else v = y[i] * silu(z[i]);
        store(a.out, row * a.d_inner + g0 + i, v, a.out_bf16);
    }
}

// ---------------------------------------------------------------------------------------
// Composition: the weighted sum every composition method reduces to for the SSM states.

struct WeightedSumArgs {
    const float* inputs;   // (count, n): the parts, one after another
    const float* weights;  // (n / block, count): each block's weight of each part
    float* out;            // (n)
    long long n;
    int count;
    int block;
};

// out[e·block + j] = Σ_i w[e·count + i] · inputs[i][e·block + j]. grid (ceil(n / 256)), block 256.
KERNEL(weighted_sum, WeightedSumArgs) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= a.n) return;
    const float* w = a.weights + (i / a.block) * a.count;
    float acc = 0.0f;
    for (int j = 0; j < a.count; ++j) acc += w[j] * a.inputs[(long long)j * a.n + i];
    a.out[i] = acc;
}

// ---------------------------------------------------------------------------------------
// The hybrids' attention and MLP.

struct ScaleArgs {
    float* x;
    long long n;
    float s;
    int pad;
};

// x *= s. grid (ceil(n / 256)), block 256.
KERNEL(scale, ScaleArgs) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < a.n) a.x[i] *= a.s;
}

// A pass's projected rows are q | k | v (heads·hd, kv_heads·hd, kv_heads·hd). The keys (and
// values) of every sequence share one pool of rows of kv_heads·hd; sequence s's region starts
// at row off[s] and holds its prev[s] earlier keys first. Its new tokens sit at RoPE positions
// pos[s], pos[s] + 1, ...
struct RopeAppendArgs {
    float* qkv;
    float* keys;              // (pool, kv_heads·hd)
    float* values;            // (pool, kv_heads·hd)
    const double* inv_freq;   // (rotary / 2)
    const int* starts;
    const int* lens;
    const int* prev;
    const int* pos;
    const int* off;
    int heads;
    int kv_heads;
    int head_dim;
    int rotary;  // channels rotated from each head's first; 0: no RoPE
};

// Rotates the first `rotary` channels of each query and key head as transformers' default RoPE
// does (channel i pairs with i + rotary/2; angles in double, as the CPU engine computes them),
// then appends the row's key and value to its sequence's cache. grid (max_len, seqs), block 256.
KERNEL(rope_append, RopeAppendArgs) {
    int s = blockIdx.y, t = blockIdx.x;
    if (t >= a.lens[s]) return;
    int qw = a.heads * a.head_dim, kvw = a.kv_heads * a.head_dim;
    float* r = a.qkv + (long long)(a.starts[s] + t) * (qw + 2 * kvw);
    int half = a.rotary / 2;
    if (half > 0) {
        double p = (double)a.pos[s] + (double)t;
        for (int i = threadIdx.x; i < (a.heads + a.kv_heads) * half; i += blockDim.x) {
            float* x = r + (i / half) * a.head_dim;  // the key heads follow the query heads
            int j = i % half;
            double angle = p * a.inv_freq[j];
            float c = (float)cos(angle), sn = (float)sin(angle);
            float x0 = x[j], x1 = x[j + half];
            x[j] = x0 * c - x1 * sn;
            x[j + half] = x1 * c + x0 * sn;
        }
        __syncthreads();
    }
    long long dst = ((long long)a.off[s] + a.prev[s] + t) * kvw;
    for (int i = threadIdx.x; i < kvw; i += blockDim.x) {
        a.keys[dst + i] = r[qw + i];
        a.values[dst + i] = r[qw + kvw + i];
    }
}

struct AttendArgs {
    const float* qkv;
    const float* keys;
    const float* values;
    void* out;  // (rows, heads·hd), f32 or bf16
    const int* starts;
    const int* lens;
    const int* prev;
    const int* off;
    int heads;
    int kv_heads;
    int head_dim;  // ≤ 256
    float scale;
    int out_bf16;
    int pad;
};

// One query row and head attending to the keys before it (its sequence's earlier keys and its
// own new ones up to itself), softmax(scale·q·k)·V as one pass over tiles of blockDim keys with
// a running max (online softmax): thread j scores key j of a tile; thread d accumulates output
// channel d. grid (max_len, heads, seqs), block 256.
KERNEL(attend, AttendArgs) {
    __shared__ float q[256];
    __shared__ float p[256];
    int s = blockIdx.z, h = blockIdx.y, t = blockIdx.x;
    if (t >= a.lens[s]) return;
    int hd = a.head_dim, qw = a.heads * hd, kvw = a.kv_heads * hd, tid = threadIdx.x;
    long long row = a.starts[s] + t;
    int n = a.prev[s] + t + 1;
    int g = h / (a.heads / a.kv_heads);
    const float* keys = a.keys + (long long)a.off[s] * kvw + g * hd;
    const float* values = a.values + (long long)a.off[s] * kvw + g * hd;
    for (int i = tid; i < hd; i += blockDim.x) q[i] = a.qkv[row * (qw + 2 * kvw) + h * hd + i];
    __syncthreads();
    float m = -3.402823466e38f, l = 0.0f, acc = 0.0f;
    for (int j0 = 0; j0 < n; j0 += blockDim.x) {
        int j = j0 + tid;
        float score = -3.402823466e38f;
        if (j < n) {
            const float* k = keys + (long long)j * kvw;
            float dot = 0.0f;
            for (int i = 0; i < hd; ++i) dot += q[i] * k[i];
            score = a.scale * dot;
        }
        float m_new = fmaxf(m, block_max(score));
        float e = j < n ? expf(score - m_new) : 0.0f;
        p[tid] = e;
        float tile = block_sum(e);  // its barriers also publish p
        float keep = expf(m - m_new);
        l = l * keep + tile;
        if (tid < hd) {
            int count = n - j0 < (int)blockDim.x ? n - j0 : (int)blockDim.x;
            float sum = 0.0f;
            for (int jj = 0; jj < count; ++jj) sum += p[jj] * values[(long long)(j0 + jj) * kvw + tid];
            acc = acc * keep + sum;
        }
        m = m_new;
        __syncthreads();  // p is rewritten by the next tile
    }
    if (tid < hd) store(a.out, row * qw + h * hd + tid, acc / l, a.out_bf16);
}

struct GluArgs {
    const float* x;  // (rows, 2·inner) gate | up for SwiGLU; (rows, inner) for relu²
    void* out;       // (rows, inner), f32 or bf16
    int inner;
    int relu2;
    int out_bf16;
    int pad;
};

// SwiGLU, silu(gate)·up, or relu(x)². grid (rows), block 256.
KERNEL(glu, GluArgs) {
    long long row = blockIdx.x;
    for (int i = threadIdx.x; i < a.inner; i += blockDim.x) {
        float v;
        if (a.relu2) {
            float r = fmaxf(a.x[row * a.inner + i], 0.0f);
            v = r * r;
        } else {
            const float* x = a.x + row * 2 * a.inner;
            v = silu(x[i]) * x[a.inner + i];
        }
        store(a.out, row * a.inner + i, v, a.out_bf16);
    }
}

struct GatherArgs {
    const float* src;  // (rows, width)
    const int* idx;    // (n)
    void* out;         // (n, width), f32 or bf16
    int width;
    int out_bf16;
};

// out[i] = src[idx[i]]. grid (n), block 256.
KERNEL(gather_rows, GatherArgs) {
    long long i = blockIdx.x;
    const float* row = a.src + (long long)a.idx[i] * a.width;
    for (int j = threadIdx.x; j < a.width; j += blockDim.x) store(a.out, i * a.width + j, row[j], a.out_bf16);
}

struct ScatterAddArgs {
    const float* src;      // (n, width)
    const int* idx;        // (n), distinct
    const float* weights;  // (n)
    float* out;            // (rows, width)
    int width;
    int pad;
};

// out[idx[i]] += weights[i]·src[i] (the rows are distinct, so no two blocks write one row).
// grid (n), block 256.
KERNEL(scatter_add_rows, ScatterAddArgs) {
    long long i = blockIdx.x;
    float* row = a.out + (long long)a.idx[i] * a.width;
    for (int j = threadIdx.x; j < a.width; j += blockDim.x) row[j] += a.weights[i] * a.src[i * a.width + j];
}
