// recur_kernels::int4_mm: y = x W^T for an int4 weight in torch's CPU packed layout
// (`_convert_weight_to_int4pack_for_cpu`), with fp32 activations, fp32 scales and fp32 sums.
// model/kernels/__init__.py builds and loads it; model/int4.py says why it exists.
//
// The layout (model/int4.py `block_rows`): the output rows in blocks of B (64 where torch's
// kernel is built for AVX-512, 32 for AVX2); within a block, each input column k holds B/2
// bytes, byte d holding row d in its low nibble and row d + B/2 in its high one. A group of
// G = 32 columns shares, per output row, a scale and a base: w = q * scale + base.
//
//   x       (M, K) fp32, contiguous
//   packed  (N' * K / 2) bytes, N' a multiple of B
//   scales  (N' / B, K / G, 2, B) fp32, or fp16 where that holds them exactly (a Q4_0 or Q4_1
//           file's d and m): [..., 0, :] the scales, [..., 1, :] the bases
//   y       (M, N') fp32
//
// Each group's sum over its 32 columns, sum_k q x_k, is taken in fp32 with the integers q
// exact, then y += scale * that + base * sum_k x_k: the product of the dequantized weight in
// fp32, up to the order of fp32's additions. One row (a decode step) unpacks each weight once
// for its FMAs; several rows unpack a group once into a buffer the size of L1's share
// (G x B floats) and run every row over it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace {

constexpr int64_t G = 32;
// bytes of integers read ahead of the unpacking (software prefetch): a decode step's weights
// come from memory, and the hardware prefetchers alone left one row's product at 0.86x
// torch's kernel; 8 KB ahead gave 1.3x (bench/int4_kernel.py, 30 layers' worth, cold)
constexpr int64_t AHEAD = 8192;

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma")
namespace avx512 {
// a vector is 16 rows
struct Isa {
  using vec = __m512;
  static constexpr int L = 16;
  static vec zero() { return _mm512_setzero_ps(); }
  static vec set1(float v) { return _mm512_set1_ps(v); }
  static vec load(const float* p) { return _mm512_loadu_ps(p); }
  static vec scales(const float* p) { return _mm512_loadu_ps(p); }
  static vec scales(const at::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
  static vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
  static vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
  // 16 bytes at p -> their low nibbles (lo) and high nibbles (hi) as 16 floats each
  static void nibbles(const uint8_t* p, vec& lo, vec& hi) {
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
};
#include "int4_body.inc"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
// a vector is 8 rows
struct Isa {
  using vec = __m256;
  static constexpr int L = 8;
  static vec zero() { return _mm256_setzero_ps(); }
  static vec set1(float v) { return _mm256_set1_ps(v); }
  static vec load(const float* p) { return _mm256_loadu_ps(p); }
  static vec scales(const float* p) { return _mm256_loadu_ps(p); }
  static vec scales(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store(float* p, vec v) { _mm256_storeu_ps(p, v); }
  static vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
  static vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
  // 8 bytes at p -> their low nibbles (lo) and high nibbles (hi) as 8 floats each
  static void nibbles(const uint8_t* p, vec& lo, vec& hi) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
};
#include "int4_body.inc"
}  // namespace avx2
#pragma GCC pop_options

namespace {

template <typename T>
void run(const T* sp, const float* xp, int64_t M, int64_t K, const uint8_t* pp, const float* xs, float* yp,
         int64_t n_padded, int64_t nblocks, int64_t B, int64_t avx512) {
  at::parallel_for(0, nblocks, 1, [&](int64_t begin, int64_t end) {
    if (avx512 && B == 64) avx512::blocks<64, T>(xp, M, K, pp, sp, xs, yp, n_padded, begin, end);
    else if (avx512) avx512::blocks<32, T>(xp, M, K, pp, sp, xs, yp, n_padded, begin, end);
    else if (B == 64) avx2::blocks<64, T>(xp, M, K, pp, sp, xs, yp, n_padded, begin, end);
    else avx2::blocks<32, T>(xp, M, K, pp, sp, xs, yp, n_padded, begin, end);
  });
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t avx512) {
  if (avx512 < 0)  // this CPU's: AVX-512 where it has the parts the build uses, else AVX2
    avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: (M, K) fp32, contiguous");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed: uint8, contiguous");
  TORCH_CHECK(scales.dim() == 4 && (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) &&
                  scales.is_contiguous() && scales.size(2) == 2,
              "scales: (N'/B, K/32, 2, B) fp32 or fp16, contiguous");
  const int64_t M = x.size(0), K = x.size(1), nblocks = scales.size(0), B = scales.size(3);
  TORCH_CHECK(K % G == 0 && scales.size(1) == K / G, "K must be a multiple of 32, with K/32 groups of scales");
  TORCH_CHECK(B == 64 || B == 32, "blocks of 64 or 32 rows");
  TORCH_CHECK(packed.numel() == nblocks * B * K / 2, "packed holds N' x K nibbles");
  const int64_t n_padded = nblocks * B;
  at::Tensor y = at::empty({M, n_padded}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // each row's sum over each group of 32 columns, for the bases (here, not by a tensor op: a
  // decode step calls this 120 times, and every op through the dispatcher costs microseconds)
  std::vector<float> sums(M * (K / G));
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < K / G; g++) {
      float t = 0.f;
      for (int64_t k = 0; k < G; k++) t += xp[m * K + g * G + k];
      sums[m * (K / G) + g] = t;
    }
  const float* xs = sums.data();
  if (scales.scalar_type() == at::kHalf)
    run(reinterpret_cast<const at::Half*>(scales.data_ptr()), xp, M, K, pp, xs, yp, n_padded, nblocks, B, avx512);
  else
    run(scales.data_ptr<float>(), xp, M, K, pp, xs, yp, n_padded, nblocks, B, avx512);
  return y;
}

}  // namespace

TORCH_LIBRARY(recur_kernels, m) {
  // avx512: -1 (this CPU's build), 1 or 0 (the AVX-512 or the AVX2 build: the tests run both)
  m.def("int4_mm(Tensor x, Tensor packed, Tensor scales, int avx512=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(recur_kernels, CPU, m) { m.impl("int4_mm", &int4_mm); }
