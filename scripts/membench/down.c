/* The sparse down projection's access pattern: neuron-major Q8_0 rows (down_t, 34 bytes a block of 32
 * outputs) of the chosen neurons summed into 2048 outputs, against streaming the dense Q4_0 down.
 *
 * Runs in: a developer's shell, outside the product (docs/sparsity.md, "What the hardware allowed"):
 *   cc -O3 -march=native -fopenmp scripts/membench/down.c -o /tmp/down
 *   /tmp/down ACTIVE_SHARE AHEAD VARIANT [L2]  (always 2 threads; the 1.1B file's shape: 22 layers, 5632 x 2048;
 *   L2 = 1: rows asked for ahead into L2, as the decoder does)
 * VARIANT 0: each thread a slice of the outputs over every chosen neuron (sparse_down.h's down_sparse
 * as it was until four neurons a pass);
 * 1: each thread half of the neurons, whole rows, two partial sums added; 2: as 1 but loads only (the
 * floor); 3: as 1, four neurons per pass over the outputs. Prints the median of 15 rounds.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define NL 22
#define NFF 5632
#define D 2048
#define NB (D/32)
#define RB (NB*34)
static inline float ldh(const uint8_t*p){uint16_t h;memcpy(&h,p,2);return _cvtsh_ss(h);}
static int l2; /* 1: prefetcht1 (into L2, as sparse_rows.h's prefetch_row_bytes), else prefetcht0 */
static inline void pf(const uint8_t*p,int n){if(l2)for(int o=0;o<n;o+=64)__builtin_prefetch(p+o,0,2); else for(int o=0;o<n;o+=64)__builtin_prefetch(p+o);}
static void blk(const uint8_t*row,float hq,float*ab){const int8_t*qb=(const int8_t*)(row+2);const __m512 sc=_mm512_set1_ps(hq*ldh(row));
 _mm512_storeu_ps(ab,_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)qb))),sc,_mm512_loadu_ps(ab)));
 _mm512_storeu_ps(ab+16,_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qb+16)))),sc,_mm512_loadu_ps(ab+16)));}
int main(int argc,char**argv){
  if(argc!=4&&argc!=5){fprintf(stderr,"usage: %s ACTIVE_SHARE AHEAD VARIANT [L2] (runs on exactly 2 threads)\n",argv[0]);return 2;}
  l2=argc==5&&atoi(argv[4]);
  omp_set_dynamic(0); omp_set_num_threads(2); /* variants 1 and 3 add two threads' partial sums; acc2 holds two */
  double act=atof(argv[1]); int ahead=atoi(argv[2]); int variant=atoi(argv[3]);
  uint8_t*dt=aligned_alloc(4096,(size_t)NL*NFF*RB); for(size_t i=0;i<(size_t)NL*NFF*RB;i++)dt[i]=(uint8_t)(i*7+1)&0x3f;
  size_t dense_b=(size_t)NL*D*NFF/32*18; uint8_t*dn=aligned_alloc(4096,dense_b); memset(dn,1,dense_b);
  int k=(int)(NFF*act); int*idx=malloc(sizeof(int)*NL*NFF); float*hv=malloc(sizeof(float)*NFF); for(int i=0;i<NFF;i++)hv[i]=0.01f*(i%7);
  float*acc2=aligned_alloc(64,sizeof(float)*2*D); float y[D];
  srand(1); double tg[15],ts[15];
  for(int it=0;it<15;it++){
    for(int l=0;l<NL;l++){int c=0;for(int j=0;j<NFF&&c<k;j++){ if(rand()%(NFF-j) < k-c) idx[l*NFF+c++]=j;}}
    double t0=now();
    for(int l=0;l<NL;l++){ const uint8_t*base=dt+(size_t)l*NFF*RB; const int*ix=idx+l*NFF;
      #pragma omp parallel
      { int T=omp_get_num_threads(),t=omp_get_thread_num();
        if(variant==0){ int b0=NB*t/T,b1=NB*(t+1)/T; float*a=acc2+t*D; memset(a,0,sizeof(float)*32*(b1-b0));
          for(int q=0;q<k;q++){const uint8_t*row=base+(size_t)ix[q]*RB+b0*34; if(q+ahead<k)pf(base+(size_t)ix[q+ahead]*RB+b0*34,34*(b1-b0));
            for(int b=0;b<b1-b0;b++)blk(row+34*b,hv[q],a+32*b);}
          for(int o=32*b0;o<32*b1;o++)y[o]=a[o-32*b0];
        } else if(variant==2){ int q0=k*t/T,q1=k*(t+1)/T; __m512i x=_mm512_setzero_si512();
          for(int q=q0;q<q1;q++){const uint8_t*row=base+(size_t)ix[q]*RB; if(q+ahead<q1)pf(base+(size_t)ix[q+ahead]*RB,RB);
            for(int o=0;o<RB-64;o+=64)x=_mm512_xor_si512(x,_mm512_loadu_si512(row+o));}
          if(_mm512_reduce_add_epi64(x)==42)y[1]+=1;
        } else if(variant==3){ /* neuron split, 4 neurons per pass over the output blocks */
          int q0=k*t/T,q1=k*(t+1)/T; float*a=acc2+t*D; memset(a,0,sizeof(float)*D);
          int q=q0;
          for(;q+4<=q1;q+=4){const uint8_t*r0=base+(size_t)ix[q]*RB,*r1=base+(size_t)ix[q+1]*RB,*r2=base+(size_t)ix[q+2]*RB,*r3=base+(size_t)ix[q+3]*RB;
            for(int p=0;p<4;p++) if(q+ahead+p<q1)pf(base+(size_t)ix[q+ahead+p]*RB,RB);
            for(int b=0;b<NB;b++){ __m512 lo=_mm512_loadu_ps(a+32*b),hi=_mm512_loadu_ps(a+32*b+16);
              const uint8_t*rr[4]={r0+34*b,r1+34*b,r2+34*b,r3+34*b};
              for(int p=0;p<4;p++){const __m512 sc=_mm512_set1_ps(hv[q+p]*ldh(rr[p]));const int8_t*qb=(const int8_t*)(rr[p]+2);
                lo=_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)qb))),sc,lo);
                hi=_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qb+16)))),sc,hi);}
              _mm512_storeu_ps(a+32*b,lo);_mm512_storeu_ps(a+32*b+16,hi);}}
          for(;q<q1;q++){const uint8_t*row=base+(size_t)ix[q]*RB; for(int b=0;b<NB;b++)blk(row+34*b,hv[q],a+32*b);}
          #pragma omp barrier
          for(int o=D*t/T;o<D*(t+1)/T;o++)y[o]=acc2[o]+acc2[D+o];
        } else { int q0=k*t/T,q1=k*(t+1)/T; float*a=acc2+t*D; memset(a,0,sizeof(float)*D);
          for(int q=q0;q<q1;q++){const uint8_t*row=base+(size_t)ix[q]*RB; if(q+ahead<q1)pf(base+(size_t)ix[q+ahead]*RB,RB);
            for(int b=0;b<NB;b++)blk(row+34*b,hv[q],a+32*b);}
          #pragma omp barrier
          for(int o=D*t/T;o<D*(t+1)/T;o++)y[o]=acc2[o]+acc2[D+o];
        }
      }
    }
    double t1=now();
    /* dense stand-in: stream the Q4_0 down bytes */
    for(int l=0;l<NL;l++){
      #pragma omp parallel
      { int T=omp_get_num_threads(),t=omp_get_thread_num(); size_t lb=(size_t)D*NFF/32*18; size_t lo=lb*t/T/64*64,hi=lb*(t+1)/T/64*64; __m512i a=_mm512_setzero_si512();
        for(size_t o=lo;o<hi;o+=64)a=_mm512_xor_si512(a,_mm512_load_si512(dn+(size_t)l*lb+o)); if(_mm512_reduce_add_epi64(a)==42)y[0]+=1;}
    }
    double t2=now(); tg[it]=t1-t0; ts[it]=t2-t1;
  }
  /* medians */
  for(int i=0;i<15;i++)for(int j=i+1;j<15;j++){if(tg[j]<tg[i]){double x=tg[i];tg[i]=tg[j];tg[j]=x;} if(ts[j]<ts[i]){double x=ts[i];ts[i]=ts[j];ts[j]=x;}}
  printf("act %.3f ahead %2d variant %d%s: sparse down %.0f us (%.1f GB/s)  dense-stream %.0f us (%.1f GB/s)  ratio %.2f  y=%g\n",act,ahead,variant,l2?" (L2)":"",tg[7]*1e6,(double)NL*k*RB/tg[7]/1e9,ts[7]*1e6,dense_b/ts[7]/1e9,tg[7]/ts[7],y[5]);
}
