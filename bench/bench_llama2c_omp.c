/*
 * bench_llama2c_omp.c: the OpenMP copy of the llama2.c baseline
 * (bench_llama2c.h): the same loop (bench_llama2c_loop.h) built with
 * -Ofast -march=native -fopenmp, as llama2.c's `make runomp` builds run.c.
 * Without OpenMP in the compiler it only reports that it is absent.
 */
#include "bench_llama2c_loop.h"

#ifdef _OPENMP
#include <omp.h>
#endif

int kvt_llama2c_omp_available(void)
{
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

void kvt_llama2c_forward_omp(kvt_llama2c *p, int token, int pos, float *logits, int threads)
{
#ifdef _OPENMP
    omp_set_num_threads(threads);
    l2c_forward(p, token, pos, logits);
#else
    (void)threads;
    kvt_llama2c_forward(p, token, pos, logits);
#endif
}
