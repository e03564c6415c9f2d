// Package fakecuda lets the tests of package infer run device memory without a GPU,
// against the repository's stand-in CUDA driver (tests/fixtures/fake_libcuda.c, which
// keeps "device" memory in host RAM). Build compiles the stand-in; the other functions
// call whatever libcuda.so.1 the process loaded, which the tests make the stand-in by
// putting Build's folder first on LD_LIBRARY_PATH of a child test process. For tests
// only.
package fakecuda

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>

static void *lib;
static int (*cu_init)(unsigned);
static int (*cu_retain)(void **, int);
static int (*cu_set_current)(void *);
static int (*cu_mem_alloc)(unsigned long long *, size_t);
static int (*cu_mem_free)(unsigned long long);
static int (*cu_htod)(unsigned long long, const void *, size_t);
static int (*cu_stream_sync)(void *);
static int (*cu_dtoh)(void *, unsigned long long, size_t);

// Opens libcuda.so.1 (once); NULL on success, else why not.
static const char *fakecuda_load(int *stand_in) {
    if (lib == NULL) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW);
        if (h == NULL) return dlerror();
        cu_init = (int (*)(unsigned))dlsym(h, "cuInit");
        cu_retain = (int (*)(void **, int))dlsym(h, "cuDevicePrimaryCtxRetain");
        cu_set_current = (int (*)(void *))dlsym(h, "cuCtxSetCurrent");
        cu_mem_alloc = (int (*)(unsigned long long *, size_t))dlsym(h, "cuMemAlloc_v2");
        cu_mem_free = (int (*)(unsigned long long))dlsym(h, "cuMemFree_v2");
        cu_htod = (int (*)(unsigned long long, const void *, size_t))dlsym(h, "cuMemcpyHtoD_v2");
        cu_stream_sync = (int (*)(void *))dlsym(h, "cuStreamSynchronize");
        cu_dtoh = (int (*)(void *, unsigned long long, size_t))dlsym(h, "cuMemcpyDtoH_v2");
        if (!cu_init || !cu_retain || !cu_set_current || !cu_mem_alloc || !cu_mem_free || !cu_htod ||
            !cu_stream_sync || !cu_dtoh)
            return "libcuda.so.1 lacks a driver function";
        lib = h;
    }
    *stand_in = dlsym(lib, "fake_cuda_counters") != NULL;
    return NULL;
}

// Makes GPU 0's primary context current on the calling thread.
static int fakecuda_bind(void) {
    void *ctx = NULL;
    int rc = cu_init(0);
    if (rc == 0) rc = cu_retain(&ctx, 0);
    if (rc == 0) rc = cu_set_current(ctx);
    return rc;
}

// Device memory on GPU 0 holding n bytes of src (binds and copies in one call, on one
// thread).
static int fakecuda_upload(const void *src, size_t n, uint64_t *out) {
    unsigned long long p = 0;
    int rc = fakecuda_bind();
    if (rc == 0) rc = cu_mem_alloc(&p, n);
    if (rc == 0) rc = cu_htod(p, src, n);
    // From pageable memory the copy may still be in flight when it returns, and the
    // library's streams are non-blocking: wait for the legacy stream.
    if (rc == 0) rc = cu_stream_sync(NULL);
    *out = p;
    return rc;
}

// Copies n bytes of device memory at src (GPU 0) to dst.
static int fakecuda_download(void *dst, uint64_t src, size_t n) {
    int rc = fakecuda_bind();
    return rc != 0 ? rc : cu_dtoh(dst, src, n);
}

static int fakecuda_free(uint64_t p) {
    int rc = fakecuda_bind();
    return rc != 0 ? rc : cu_mem_free(p);
}
*/
import "C"

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"unsafe"
)

// Build compiles source (tests/fixtures/fake_libcuda.c) with cc into dir as
// libcuda.so.1, with a libcuda.so link to it.
func Build(source, dir string) error {
	lib := filepath.Join(dir, "libcuda.so.1")
	out, err := exec.Command("cc", "-shared", "-fPIC", "-O1", "-pthread", "-o", lib, source, "-lm").CombinedOutput()
	if err != nil {
		return fmt.Errorf("cc %s: %v\n%s", source, err, out)
	}
	return os.Symlink("libcuda.so.1", filepath.Join(dir, "libcuda.so"))
}

// Load opens the process's libcuda.so.1 and reports whether it is the stand-in.
func Load() (standIn bool, err error) {
	var s C.int
	if why := C.fakecuda_load(&s); why != nil {
		return false, fmt.Errorf("loading libcuda.so.1: %s", C.GoString(why))
	}
	return s != 0, nil
}

// Upload allocates device memory on GPU 0 holding the bytes of data and returns its
// device address. Load must have succeeded.
func Upload(data []byte) (uintptr, error) {
	var p C.uint64_t
	var src unsafe.Pointer
	if len(data) > 0 {
		src = unsafe.Pointer(&data[0])
	}
	if rc := C.fakecuda_upload(src, C.size_t(len(data)), &p); rc != 0 {
		return 0, fmt.Errorf("uploading %d bytes: CUDA error %d", len(data), int(rc))
	}
	return uintptr(p), nil
}

// Download copies n bytes of GPU 0's device memory at p to a new slice. Load must have
// succeeded.
func Download(p uintptr, n int) ([]byte, error) {
	out := make([]byte, n)
	if n == 0 {
		return out, nil
	}
	if rc := C.fakecuda_download(unsafe.Pointer(&out[0]), C.uint64_t(p), C.size_t(n)); rc != 0 {
		return nil, fmt.Errorf("downloading %d bytes at %#x: CUDA error %d", n, p, int(rc))
	}
	return out, nil
}

// Free frees device memory Upload returned.
func Free(p uintptr) error {
	if rc := C.fakecuda_free(C.uint64_t(p)); rc != 0 {
		return fmt.Errorf("freeing %#x: CUDA error %d", p, int(rc))
	}
	return nil
}
