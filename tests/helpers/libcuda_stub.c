/*
 * A stand-in CUDA driver (libcuda.so.1) for hosts without a GPU: every driver call answers
 * CUDA_ERROR_NO_DEVICE, so a process that loads it still sees no device, while the shared
 * objects that link against libcuda.so.1 (DeepEP's, TokenSpeed's kernel objects, Mooncake's)
 * can be loaded, which is what importing tokenspeed_kernel needs.
 *
 * tests/helpers/tokenspeed_cpu.py compiles it with the system C compiler:
 *     cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so.1 libcuda_stub.c
 * and loads it into the test process with RTLD_GLOBAL; the dynamic loader then binds every later
 * request for libcuda.so.1 to it by its soname.
 *
 * The list below is every cu* symbol that the shared objects of TokenSpeed 0.1.1's environment
 * import from libcuda.so.1 (read with nm -D --undefined-only), plus the entry points the CUDA
 * runtime asks for first. Python loads extensions with RTLD_NOW, so a missing one fails the load.
 * The functions ignore their arguments: under the x86-64 and AArch64 calling conventions a
 * caller's arguments need not match the callee's parameter list.
 */

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_NO_DEVICE 100

#define NO_DEVICE(name) \
    int name(void) { return CUDA_ERROR_NO_DEVICE; }

NO_DEVICE(cuInit)
NO_DEVICE(cuDeviceGetCount)
NO_DEVICE(cuDeviceGet)
NO_DEVICE(cuDeviceGetAttribute)
NO_DEVICE(cuDeviceGetName)
NO_DEVICE(cuDevicePrimaryCtxRetain)
NO_DEVICE(cuDevicePrimaryCtxRelease_v2)
NO_DEVICE(cuDevicePrimaryCtxGetState)
NO_DEVICE(cuGetProcAddress)
NO_DEVICE(cuGetProcAddress_v2)
NO_DEVICE(cuGetExportTable)
NO_DEVICE(cuCtxGetCurrent)
NO_DEVICE(cuCtxSetCurrent)
NO_DEVICE(cuCtxGetDevice)
NO_DEVICE(cuCtxGetId)
NO_DEVICE(cuMemCreate)
NO_DEVICE(cuMemRelease)
NO_DEVICE(cuMemMap)
NO_DEVICE(cuMemUnmap)
NO_DEVICE(cuMemSetAccess)
NO_DEVICE(cuMemAddressReserve)
NO_DEVICE(cuMemAddressFree)
NO_DEVICE(cuMemGetAddressRange_v2)
NO_DEVICE(cuMemGetAllocationGranularity)
NO_DEVICE(cuMemRetainAllocationHandle)
NO_DEVICE(cuMemExportToShareableHandle)
NO_DEVICE(cuMemImportFromShareableHandle)
NO_DEVICE(cuMemGetHandleForAddressRange)
NO_DEVICE(cuPointerGetAttribute)
NO_DEVICE(cuPointerSetAttribute)
NO_DEVICE(cuModuleLoad)
NO_DEVICE(cuModuleLoadData)
NO_DEVICE(cuModuleLoadDataEx)
NO_DEVICE(cuModuleUnload)
NO_DEVICE(cuModuleGetFunction)
NO_DEVICE(cuLibraryLoadData)
NO_DEVICE(cuLibraryUnload)
NO_DEVICE(cuLibraryGetKernelCount)
NO_DEVICE(cuLibraryEnumerateKernels)
NO_DEVICE(cuKernelGetName)
NO_DEVICE(cuLinkCreate_v2)
NO_DEVICE(cuLinkAddData_v2)
NO_DEVICE(cuLinkComplete)
NO_DEVICE(cuFuncGetAttribute)
NO_DEVICE(cuFuncSetAttribute)
NO_DEVICE(cuFuncSetCacheConfig)
NO_DEVICE(cuLaunchKernel)
NO_DEVICE(cuLaunchKernelEx)
NO_DEVICE(cuLaunchCooperativeKernel)
NO_DEVICE(cuOccupancyMaxActiveBlocksPerMultiprocessor)
NO_DEVICE(cuTensorMapEncodeTiled)

/* The driver's version and its error texts answer as a real driver would with no device present. */
int cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = 13000;
    return CUDA_SUCCESS;
}

int cuGetErrorName(int error, const char **text) {
    if (!text) return CUDA_ERROR_INVALID_VALUE;
    *text = error == CUDA_ERROR_NO_DEVICE ? "CUDA_ERROR_NO_DEVICE" : "CUDA_ERROR_UNKNOWN";
    return CUDA_SUCCESS;
}

int cuGetErrorString(int error, const char **text) {
    if (!text) return CUDA_ERROR_INVALID_VALUE;
    *text = error == CUDA_ERROR_NO_DEVICE ? "no CUDA-capable device is detected" : "unknown error";
    return CUDA_SUCCESS;
}
