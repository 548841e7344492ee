// Measures this CPU's float32 peak: FMA throughput per core and the core clock.
//
// Each thread runs CHAINS independent vector FMA chains (enough to cover the FMA latency on
// every port), so the loop is bound by FMA throughput alone; the clock comes from a chain of
// dependent integer adds (one cycle each). Build: cc -O2 -march=native -ffp-contract=fast
// -pthread peak_flops.c (bench/machine.py does, and runs it on every core).
// Output (one line, JSON): threads, GFLOP/s over all threads, GHz, FLOPs per cycle per core.
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#ifndef VECTOR_BYTES
#define VECTOR_BYTES 64
#endif
#define LANES (VECTOR_BYTES / 4)
#define CHAINS 12
typedef float vec __attribute__((vector_size(VECTOR_BYTES)));

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

static long iterations = 20000000;
static float sink;

static void *fma_loop(void *arg) {
  (void)arg;
  vec mul, add;
  for (int k = 0; k < LANES; k++) { mul[k] = 0.9999999f; add[k] = 1e-7f; }
  vec a0 = add, a1 = add * 2, a2 = add * 3, a3 = add * 4, a4 = add * 5, a5 = add * 6,
      a6 = add * 7, a7 = add * 8, a8 = add * 9, a9 = add * 10, a10 = add * 11, a11 = add * 12;
  for (long i = 0; i < iterations; i++) {
    // Twelve independent chains, each contracted to one FMA per iteration; the empty asm
    // keeps the compiler from folding iterations together.
    a0 = a0 * mul + add; a1 = a1 * mul + add; a2 = a2 * mul + add; a3 = a3 * mul + add;
    a4 = a4 * mul + add; a5 = a5 * mul + add; a6 = a6 * mul + add; a7 = a7 * mul + add;
    a8 = a8 * mul + add; a9 = a9 * mul + add; a10 = a10 * mul + add; a11 = a11 * mul + add;
    __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5),
                     "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
  }
  vec total = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;
  for (int k = 0; k < LANES; k++) sink += total[k];
  return NULL;
}

static double clock_ghz(void) {
  const long n = 100000000;
  uint64_t x = 0;
  double start = now();
  for (long i = 0; i < n; i += 10) {
    __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                     "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0"
                     : "+r"(x));
  }
  double seconds = now() - start;
  if (x != (uint64_t)n) return -1;
  return n / seconds / 1e9;
}

int main(int argc, char **argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 1;
  if (argc > 2) iterations = atol(argv[2]);
  pthread_t ids[256];
  fma_loop(NULL);  // warm-up: let the clock settle
  double start = now();
  for (int t = 0; t < threads; t++) pthread_create(&ids[t], NULL, fma_loop, NULL);
  for (int t = 0; t < threads; t++) pthread_join(ids[t], NULL);
  double seconds = now() - start;
  double flops = 2.0 * LANES * CHAINS * (double)iterations * threads;
  double ghz = clock_ghz();
  printf("{\"threads\": %d, \"vector_bits\": %d, \"gflops\": %.2f, \"ghz\": %.3f, "
         "\"flops_per_cycle_per_core\": %.2f}\n", threads, VECTOR_BYTES * 8,
         flops / seconds / 1e9, ghz, flops / seconds / 1e9 / ghz / threads);
  return sink == 12345.0f;
}
