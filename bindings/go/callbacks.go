package infer

// The Go side of the library's callbacks. This file's preamble holds declarations only:
// cgo copies the preamble of a file with //export into two C files.

/*
#include "bridge.h"
*/
import "C"

import (
	"runtime/cgo"
	"sync/atomic"
)

// responseSink receives the responses of one enqueued request, on a library thread.
// deliver owns resp and must not block: the thread serves the model.
type responseSink interface {
	deliver(resp *C.infer_response, final bool)
}

// liveSinks counts enqueued requests whose FINAL has not arrived yet; tests use it to
// check that every request got exactly one FINAL and nothing is left behind.
var liveSinks atomic.Int64

//export goinferOnResponse
func goinferOnResponse(handle C.uintptr_t, resp *C.infer_response, flags C.uint32_t) {
	h := cgo.Handle(handle)
	sink := h.Value().(responseSink)
	final := flags&C.INFER_RESPONSE_FLAG_FINAL != 0
	if final {
		// The library never uses user_data after the FINAL call.
		h.Delete()
		liveSinks.Add(-1)
	}
	sink.deliver(resp, final)
}

// liveReleases counts release functions of device inputs the library has not called
// yet; tests use it to check that each one ran once.
var liveReleases atomic.Int64

//export goinferOnRelease
func goinferOnRelease(handle C.uintptr_t) {
	h := cgo.Handle(handle)
	release := h.Value().(func())
	// The library calls each release callback at most once.
	h.Delete()
	liveReleases.Add(-1)
	release()
}

//export goinferOnLog
func goinferOnLog(handle C.uintptr_t, level C.uint32_t, message *C.char) {
	log := cgo.Handle(handle).Value().(func(LogLevel, string))
	log(LogLevel(level), C.GoString(message))
}

//export goinferOnIterationStats
func goinferOnIterationStats(handle C.uintptr_t, json *C.char) {
	fn := cgo.Handle(handle).Value().(func(string))
	fn(C.GoString(json))
}

// enqueue sends req with sink as the receiver of its responses and returns the
// request's id. The request is consumed either way; on failure sink is never called.
// The sink may receive responses, even the FINAL, before enqueue returns.
func (s *Server) enqueue(req *Request, sink responseSink) (uint64, error) {
	p := req.take()
	if p == nil {
		return 0, errRequestUsed
	}
	h := cgo.NewHandle(sink)
	liveSinks.Add(1)
	var id C.uint64_t
	sent := false
	err := s.use(func(sp *C.infer_server) error {
		sent = true
		return call(func() C.infer_status { return C.goinfer_enqueue(sp, p, C.uintptr_t(h), &id) })
	})
	if err != nil {
		if !sent {
			C.infer_request_free(p)
		}
		liveSinks.Add(-1)
		h.Delete()
		return 0, err
	}
	return uint64(id), nil
}
