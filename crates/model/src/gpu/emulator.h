// Runs kernels.cu on the CPU, for the tests of a machine without a GPU: compiled with the
// system's C++ compiler into a shared library (gpu/emulator.rs). Each launch runs the grid's
// blocks one after another, each with blockDim real threads, so `__syncthreads` is a barrier
// and `__shared__` (a function-static here) is shared by one block's threads, as on a GPU.
// A kernel that breaks CUDA's rules (a barrier not reached by every thread, a race on shared
// memory, an out-of-bounds write) hangs or fails here too, under the tests' sanitizers.
#include <cmath>
#include <cstring>
#include <functional>
#include <pthread.h>
#include <thread>
#include <vector>

struct emu_dim3 {
    unsigned x, y, z;
};
static thread_local emu_dim3 threadIdx, blockIdx;
static emu_dim3 blockDim, gridDim;
static pthread_barrier_t emu_barrier;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

inline void __syncthreads() { pthread_barrier_wait(&emu_barrier); }
inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}

static void emu_run_grid(const std::function<void()>& body) {
    unsigned threads = blockDim.x * blockDim.y * blockDim.z;
    pthread_barrier_init(&emu_barrier, nullptr, threads);
    std::vector<std::thread> pool;
    for (unsigned i = 0; i < threads; ++i) {
        pool.emplace_back([i, &body] {
            threadIdx = {i % blockDim.x, (i / blockDim.x) % blockDim.y, i / (blockDim.x * blockDim.y)};
            for (unsigned z = 0; z < gridDim.z; ++z)
                for (unsigned y = 0; y < gridDim.y; ++y)
                    for (unsigned x = 0; x < gridDim.x; ++x) {
                        blockIdx = {x, y, z};
                        body();
                        // Every thread ends the block before the next one reuses shared memory.
                        pthread_barrier_wait(&emu_barrier);
                    }
        });
    }
    for (auto& t : pool) t.join();
    pthread_barrier_destroy(&emu_barrier);
}

extern "C" void emu_config(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz) {
    gridDim = {gx, gy, gz};
    blockDim = {bx, by, bz};
}

#define KERNEL(name, Args)                                                      \
    static void name##_body(const Args a);                                      \
    extern "C" void name(const void* p) {                                       \
        Args args;                                                              \
        std::memcpy(&args, p, sizeof(Args));                                    \
        emu_run_grid([&args] { name##_body(args); });                           \
    }                                                                           \
    extern "C" unsigned long name##_args_size() { return sizeof(Args); }        \
    static void name##_body(const Args a)
