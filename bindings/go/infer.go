// Package infer is the Go binding of libinfer, an inference server that runs inside the
// process: load models from Triton-style configs, send requests from any goroutine, and
// get responses back as return values or on channels while the library batches,
// schedules and executes them.
//
// The package wraps the C API of include/infer.h with cgo. Every object that holds C
// memory (Server, Request, Response) has an idempotent Close; a Request is consumed by the
// call that sends it. Errors are *Error values carrying the library's status Code.
//
// Linking: cgo looks for libinfer.so in bindings/go/.lib and then in target/release, and
// the programs it builds look for libinfer.so.0 (the library's soname) in the same two
// folders. scripts/test_go.sh makes the links in .lib; elsewhere set CGO_LDFLAGS and
// LD_LIBRARY_PATH.
package infer

/*
#cgo CFLAGS: -I${SRCDIR}/../../include
#cgo LDFLAGS: -L${SRCDIR}/.lib -L${SRCDIR}/../../target/release -linfer
#cgo LDFLAGS: -Wl,-rpath,${SRCDIR}/.lib -Wl,-rpath,${SRCDIR}/../../target/release
#include "bridge.h"
*/
import "C"

import (
	"fmt"
	"runtime"
	"strings"
	"unsafe"
)

// The C API version this package was built against (include/infer.h).
const (
	APIVersionMajor = C.INFER_API_VERSION_MAJOR
	APIVersionMinor = C.INFER_API_VERSION_MINOR
)

// LatestVersion asks for the latest ready version of a model.
const LatestVersion int64 = -1

// APIVersion returns the C API version the loaded library implements.
func APIVersion() (major, minor uint32) {
	var libMajor, libMinor C.uint32_t
	C.infer_api_version(&libMajor, &libMinor)
	return uint32(libMajor), uint32(libMinor)
}

// Version returns the library's version, e.g. "0.1.0".
func Version() string {
	return C.GoString(C.infer_version())
}

// checkAPIVersion applies the C API's compatibility rule: a client built against
// MAJOR.MINOR works with a library of the same MAJOR and a MINOR at least as high.
func checkAPIVersion(libMajor, libMinor, wantMajor, wantMinor uint32) error {
	if libMajor != wantMajor || libMinor < wantMinor {
		return newError(Unavailable, fmt.Sprintf(
			"libinfer C API %d.%d is loaded, but this binding needs %d.%d (same major, minor at least as high)",
			libMajor, libMinor, wantMajor, wantMinor))
	}
	return nil
}

// call runs one fallible C call and turns a failure into an *Error with the library's
// message. The message is thread-local in the library, so the goroutine stays on one OS
// thread from the call to the read.
func call(f func() C.infer_status) error {
	runtime.LockOSThread()
	st := f()
	var err error
	if st != C.INFER_STATUS_OK {
		err = newError(Code(st), C.GoString(C.infer_last_error_message()))
	}
	runtime.UnlockOSThread()
	return err
}

// cString copies s into C memory for a call; the caller frees it with freeCString.
// Strings with a NUL byte cannot cross the C API unchanged and are refused.
func cString(what, s string) (*C.char, error) {
	if strings.IndexByte(s, 0) >= 0 {
		return nil, newError(InvalidArgument, fmt.Sprintf("%s %q contains a NUL byte", what, s))
	}
	return C.CString(s), nil
}

// cStringOrNil is cString with "" passed as NULL (the C API's "not given").
func cStringOrNil(what, s string) (*C.char, error) {
	if s == "" {
		return nil, nil
	}
	return cString(what, s)
}

func freeCString(p *C.char) {
	if p != nil {
		C.free(unsafe.Pointer(p))
	}
}

// ownedString runs a call that hands back a string the caller must free with
// infer_string_free, and returns a Go copy.
func ownedString(f func(out **C.char) C.infer_status) (string, error) {
	var out *C.char
	if err := call(func() C.infer_status { return f(&out) }); err != nil {
		return "", err
	}
	s := C.GoString(out)
	C.infer_string_free(out)
	return s, nil
}
