package infer

/*
#include "infer.h"
*/
import "C"

import (
	"context"
	"sync"
)

// oneShot is the sink of Server.Infer: it keeps the FINAL response for the waiting
// caller, or frees it once the caller has gone (its context ended).
type oneShot struct {
	mu        sync.Mutex
	abandoned bool
	final     chan *C.infer_response // capacity 1: deliver never blocks
}

func (c *oneShot) deliver(resp *C.infer_response, final bool) {
	if !final {
		// Infer answers with the FINAL response; Stream is for models that send more.
		C.infer_response_free(resp)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.abandoned {
		C.infer_response_free(resp)
		return
	}
	c.final <- resp
}

// abandon tells deliver to free what comes from now on, and returns the FINAL response
// if it came already.
func (c *oneShot) abandon() *C.infer_response {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.abandoned = true
	select {
	case resp := <-c.final:
		return resp
	default:
		return nil
	}
}

// Infer sends req (consuming it) and waits for its FINAL response. A request that fails
// in the model returns the model's error and no Response; on success the caller owns the
// Response and closes it.
//
// When ctx ends first, the request is cancelled with the library (a queued request ends
// at once; one already executing finishes and its result is dropped) and Infer returns
// an *Error with code Cancelled or DeadlineExceeded that also matches ctx.Err() with
// errors.Is. Infer starts no goroutine.
func (s *Server) Infer(ctx context.Context, req *Request) (*Response, error) {
	if ctx.Err() != nil {
		req.Close()
		return nil, contextError(ctx)
	}
	sink := &oneShot{final: make(chan *C.infer_response, 1)}
	id, err := s.enqueue(req, sink)
	if err != nil {
		return nil, err
	}
	select {
	case resp := <-sink.final:
		return finalResponse(resp)
	case <-ctx.Done():
	}
	_ = s.Cancel(id) // NotFound when it finished meanwhile; the FINAL comes either way
	if resp := sink.abandon(); resp != nil {
		if C.infer_response_status(resp) == C.INFER_STATUS_OK {
			return finalResponse(resp) // finished as the context ended: keep the result
		}
		C.infer_response_free(resp)
	}
	return nil, contextError(ctx)
}

// finalResponse turns a FINAL response into Infer's result.
func finalResponse(p *C.infer_response) (*Response, error) {
	resp := newResponse(p)
	if err := resp.Err(); err != nil {
		resp.Close()
		return nil, err
	}
	return resp, nil
}

// callbackSink runs the function given to Server.Enqueue.
type callbackSink func(resp *Response, final bool)

func (f callbackSink) deliver(resp *C.infer_response, final bool) {
	f(newResponse(resp), final)
}

// Enqueue sends req (consuming it) and returns the request's id, for Cancel. On success
// onResponse is called one or more times, on a library thread, and exactly one call has
// final set: the last. Each call owns resp (Close it; resp.Err() is the request's
// status). onResponse must not block and must not call Infer, Shutdown or Close; it may
// send requests (a sequence's next step) and cancel. It may run before Enqueue returns.
// On failure onResponse is never called.
func (s *Server) Enqueue(req *Request, onResponse func(resp *Response, final bool)) (uint64, error) {
	if onResponse == nil {
		req.Close()
		return 0, newError(InvalidArgument, "Enqueue needs a response function")
	}
	return s.enqueue(req, callbackSink(onResponse))
}
