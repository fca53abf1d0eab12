/* Scattered-row read bandwidth against a stream, the access pattern of the sparse FFN's chosen rows.
 *
 * Runs in: a developer's shell, outside the product (docs/sparsity.md, "What the hardware allowed"):
 *   cc -O3 -march=native -fopenmp scripts/membench/gather.c -o /tmp/gather
 *   OMP_NUM_THREADS=2 /tmp/gather ROW_BYTES ROWS ACTIVE_SHARE AHEAD MATRICES [L2]
 *   e.g. 1152 5632 0.135 8 44: the 1.1B file's gate and up rows (Q4_0, 2048 wide) at 13.5% active.
 * Each of 20 rounds draws a fresh sorted random active set per matrix, reads those rows (prefetching
 * AHEAD rows ahead, 0: none; into L1 with prefetcht0, or with L2 = 1 into L2 with prefetcht1, as
 * sparse_rows.h's prefetch_row_bytes) with AVX-512 loads and nothing else, then streams every matrix
 * whole; prints the best round of each. Loads only: a kernel that also computes cannot beat it.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
/* read n bytes at p, return xor-sum (AVX-512 loads) */
static inline __m512i rd(const uint8_t*p,size_t n,__m512i acc){for(size_t o=0;o<n;o+=64)acc=_mm512_xor_si512(acc,_mm512_loadu_si512(p+o));return acc;}
int main(int argc,char**argv){
  if(argc!=6&&argc!=7){fprintf(stderr,"usage: %s ROW_BYTES ROWS ACTIVE_SHARE AHEAD MATRICES [L2]\n",argv[0]);return 2;}
  int l2=argc==7&&atoi(argv[6]);
  size_t rowb=atoi(argv[1]); int nrows=atoi(argv[2]); double act=atof(argv[3]); int ahead=atoi(argv[4]); int nmat=atoi(argv[5]);
  size_t mb=rowb*nrows; uint8_t*buf=aligned_alloc(4096,mb*nmat); memset(buf,1,mb*nmat);
  int k=(int)(nrows*act); int*idx=malloc(sizeof(int)*nrows*nmat);
  srand(1);
  double best_s=1e9,best_g=1e9; __m512i acc=_mm512_setzero_si512();
  for(int it=0;it<20;it++){
    /* fresh random sorted active set per matrix */
    for(int m=0;m<nmat;m++){int c=0;for(int j=0;j<nrows&&c<k;j++){ if(rand()%(nrows-j) < k-c) idx[m*nrows+c++]=j;}}
    double t0=now();
    #pragma omp parallel
    { int T=omp_get_num_threads(),t=omp_get_thread_num(); __m512i a=_mm512_setzero_si512();
      for(int m=0;m<nmat;m++){ const uint8_t*base=buf+m*mb; int lo=k*t/T,hi=k*(t+1)/T; int*ix=idx+m*nrows;
        for(int i=lo;i<hi;i++){ if(ahead>0&&i+ahead<hi){const uint8_t*q=base+(size_t)ix[i+ahead]*rowb; if(l2)for(size_t o=0;o<rowb;o+=64)__builtin_prefetch(q+o,0,2); else for(size_t o=0;o<rowb;o+=64)__builtin_prefetch(q+o);} a=rd(base+(size_t)ix[i]*rowb,rowb,a);} }
      _Pragma("omp critical") acc=_mm512_xor_si512(acc,a);}
    double t1=now();
    #pragma omp parallel
    { int T=omp_get_num_threads(),t=omp_get_thread_num(); __m512i a=_mm512_setzero_si512();
      for(int m=0;m<nmat;m++){ size_t lo=mb*t/T/64*64,hi=mb*(t+1)/T/64*64; a=rd(buf+m*mb+lo,hi-lo,a);} _Pragma("omp critical") acc=_mm512_xor_si512(acc,a);}
    double t2=now();
    if(t1-t0<best_g)best_g=t1-t0; if(t2-t1<best_s)best_s=t2-t1;
  }
  double gb=(double)k*rowb*nmat/1e9, sb=(double)mb*nmat/1e9;
  printf("rowb %zu act %.3f ahead %d%s: gather %.1f GB/s (%.3f ms)  stream %.1f GB/s (%.3f ms)  ratio time %.2f  [%lld]\n",rowb,act,ahead,l2?" (L2)":"",gb/best_g,best_g*1e3,sb/best_s,best_s*1e3,best_g/best_s,(long long)_mm512_reduce_add_epi64(acc)&1);
}
