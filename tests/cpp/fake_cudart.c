/* The two CUDA runtime calls PyTorch makes before a raw allocation reaches
 * the pluggable allocator (torch._C._cuda_cudaCachingAllocator_raw_alloc:
 * which device is current, and whether there is one). Preloaded into a test
 * process over torch's own libcudart, so that on a machine without a GPU
 * PyTorch's real allocation path, and its real exception translation, run
 * down to Waterwave over the fake driver (fake_cuda.c). Every other runtime
 * call stays torch's. */
int cudaGetDevice(int* device) {
  *device = 0;
  return 0; /* cudaSuccess */
}

int cudaGetDeviceCount(int* count) {
  *count = 1;
  return 0;
}
