// Does cuBLASLt fuse relu's backward into a GEMM on this GPU? Times every algorithm its heuristic offers for the
// feed-forward backward GEMM dh = dy @ W^T, (R x N) x (N x F) in bf16 (TN in cuBLASLt's column-major terms), with
// epilogues DEFAULT, DRELU (relu's bit mask applied) and DRELU_BGRAD (and the bias gradient summed). Prints the
// median of 20 timed calls per algorithm. Inputs are zeros and an all-ones mask: the time does not depend on them.
//
//   nvcc -std=c++17 -o /tmp/cublaslt_epilogue_probe scripts/cublaslt_epilogue_probe.cu -lcublasLt
//   /tmp/cublaslt_epilogue_probe R N F        (default 8192 1024 4096: Transformer-big at 8192 tokens)
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <vector>
#include <algorithm>
#define CK(x) do { auto s = (x); if (s != 0) { printf("err %s:%d %d\n", __FILE__, __LINE__, (int)s); } } while (0)
int main(int argc, char** argv) {
  long R = 8192, N = 1024, F = 4096;
  if (argc > 3) { R = atol(argv[1]); N = atol(argv[2]); F = atol(argv[3]); }
  cublasLtHandle_t h; CK(cublasLtCreate(&h));
  void *A, *B, *D, *mask, *bias, *ws; size_t wsb = 32 << 20;
  cudaMalloc(&A, N * F * 2); cudaMalloc(&B, N * R * 2); cudaMalloc(&D, F * R * 2); cudaMalloc(&mask, F * R / 8);
  cudaMalloc(&bias, F * 4); cudaMalloc(&ws, wsb);
  cudaMemset(A, 0, N * F * 2); cudaMemset(B, 0, N * R * 2); cudaMemset(mask, 0xff, F * R / 8);
  cublasLtEpilogue_t epis[] = {CUBLASLT_EPILOGUE_DEFAULT, CUBLASLT_EPILOGUE_DRELU, CUBLASLT_EPILOGUE_DRELU_BGRAD};
  const char* names[] = {"DEFAULT", "DRELU", "DRELU_BGRAD"};
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  for (int ei = 0; ei < 3; ++ei) {
    cublasLtMatmulDesc_t desc; CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const long m = F, n = R, k = N;
    cublasLtMatrixLayout_t a, b, d;
    CK(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, N, F, N));
    CK(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, N, R, N));
    CK(cublasLtMatrixLayoutCreate(&d, CUDA_R_16BF, F, R, F));
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epis[ei], sizeof(epis[ei])));
    if (ei == 1 || ei == 2) {
      CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &mask, sizeof(mask)));
      long ld = F; CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)));
    }
    if (ei == 2) CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    cublasLtMatmulPreference_t pref; CK(cublasLtMatmulPreferenceCreate(&pref));
    CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
    cublasLtMatmulHeuristicResult_t res[32]; int count = 0;
    CK(cublasLtMatmulAlgoGetHeuristic(h, desc, a, b, d, d, pref, 32, res, &count));
    printf("%s: %d algorithms (m=%ld n=%ld k=%ld)\n", names[ei], count, m, n, k);
    for (int i = 0; i < count; ++i) {
      float alpha = 1, beta = 0; std::vector<float> t;
      for (int rep = 0; rep < 25; ++rep) {
        cudaEventRecord(e0);
        auto s = cublasLtMatmul(h, desc, &alpha, A, a, B, b, &beta, D, d, D, d, &res[i].algo, ws, wsb, 0);
        cudaEventRecord(e1); cudaEventSynchronize(e1);
        if (s != 0) { printf("  algo %d: status %d\n", i, (int)s); break; }
        float ms; cudaEventElapsedTime(&ms, e0, e1); if (rep >= 5) t.push_back(ms);
      }
      if (t.empty()) continue;
      std::sort(t.begin(), t.end());
      int id = 0, tile = 0, splitk = 0; size_t w;
      cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &w);
      cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &w);
      cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &w);
      printf("  algo %2d id %3d tile %3d splitk %d ws %8zu  median %.4f ms  (%.0f TFLOP/s)\n", i, id, tile, splitk,
             res[i].workspaceSize, t[t.size() / 2], 2.0 * m * n * k / (t[t.size() / 2] * 1e9));
    }
  }
  return 0;
}
