package infer

/*
#include "infer.h"
*/
import "C"

import (
	"context"
	"sync"
)

// StreamItem is one response on a stream's channel.
type StreamItem struct {
	// Response is never nil; the receiver owns it and closes it.
	Response *Response
	// Err is Response.Err(): nil on success, else the status the request ended with.
	Err error
	// Final marks the last response of its request.
	Final bool
}

// responseStream delivers the responses of one or more requests, in arrival order, on
// one channel. Library threads append to queue (never blocking); one goroutine, forward,
// hands items to the receiver and closes the channel when the stream is sealed and every
// request has had its FINAL, or when ctx ends. After ctx ends, the requests still in
// flight are cancelled and whatever they send is freed.
type responseStream struct {
	server *Server
	ctx    context.Context
	out    chan StreamItem
	wake   chan struct{} // capacity 1: a pending wake-up is enough

	mu        sync.Mutex
	queue     []StreamItem
	pending   int  // requests sent whose FINAL has not come
	sealed    bool // no more requests will be sent
	abandoned bool // ctx ended: free what comes, deliver nothing
	inflight  map[*streamRequest]struct{}
}

// streamRequest is the sink of one request of a stream.
type streamRequest struct {
	stream *responseStream
	id     uint64 // known once enqueue returned
	done   bool   // FINAL came
}

func newResponseStream(s *Server, ctx context.Context) *responseStream {
	return &responseStream{
		server:   s,
		ctx:      ctx,
		out:      make(chan StreamItem),
		wake:     make(chan struct{}, 1),
		inflight: make(map[*streamRequest]struct{}),
	}
}

func (r *streamRequest) deliver(p *C.infer_response, final bool) {
	st := r.stream
	st.mu.Lock()
	if final {
		r.done = true
		st.pending--
		delete(st.inflight, r)
	}
	if st.abandoned {
		st.mu.Unlock()
		C.infer_response_free(p)
		return
	}
	resp := newResponse(p)
	st.queue = append(st.queue, StreamItem{Response: resp, Err: resp.Err(), Final: final})
	st.mu.Unlock()
	st.notify()
}

func (st *responseStream) notify() {
	select {
	case st.wake <- struct{}{}:
	default:
	}
}

// send enqueues one more request of the stream.
func (st *responseStream) send(req *Request) error {
	st.mu.Lock()
	switch {
	case st.abandoned || st.ctx.Err() != nil:
		st.mu.Unlock()
		req.Close()
		return contextError(st.ctx)
	case st.sealed:
		st.mu.Unlock()
		req.Close()
		return newError(InvalidArgument, "the sequence has ended or is closed")
	}
	st.pending++
	st.mu.Unlock()

	r := &streamRequest{stream: st}
	id, err := st.server.enqueue(req, r)
	st.mu.Lock()
	if err != nil {
		st.pending--
		st.mu.Unlock()
		st.notify() // a sealed stream may be finished now
		return err
	}
	r.id = id
	cancel := false
	if !r.done {
		st.inflight[r] = struct{}{}
		cancel = st.abandoned // ctx ended while it was being sent
	}
	st.mu.Unlock()
	if cancel {
		_ = st.server.Cancel(id)
	}
	return nil
}

// seal says no more requests will be sent; the channel closes after the last FINAL.
func (st *responseStream) seal() {
	st.mu.Lock()
	st.sealed = true
	st.mu.Unlock()
	st.notify()
}

func (st *responseStream) forward() {
	defer close(st.out)
	done := st.ctx.Done()
	for {
		st.mu.Lock()
		if len(st.queue) > 0 {
			item := st.queue[0]
			st.queue[0] = StreamItem{}
			st.queue = st.queue[1:]
			st.mu.Unlock()
			select {
			case st.out <- item:
				continue
			case <-done:
				item.Response.Close()
				st.abandon()
				return
			}
		}
		finished := st.sealed && st.pending == 0
		st.mu.Unlock()
		if finished {
			return
		}
		select {
		case <-st.wake:
		case <-done:
			st.abandon()
			return
		}
	}
}

// abandon frees what was not delivered and cancels the requests still in flight; their
// FINALs are freed on arrival.
func (st *responseStream) abandon() {
	st.mu.Lock()
	st.abandoned = true
	queued := st.queue
	st.queue = nil
	var ids []uint64
	for r := range st.inflight {
		ids = append(ids, r.id)
	}
	st.mu.Unlock()
	for _, item := range queued {
		item.Response.Close()
	}
	for _, id := range ids {
		_ = st.server.Cancel(id) // NotFound when it finished meanwhile
	}
}

// Stream sends req (consuming it) and returns a channel with each of its responses, in
// order; the item of the FINAL response has Final set and the channel is closed after
// it. Use it for models that send several responses per request; for one response,
// Infer is simpler.
//
// Receive until the channel is closed, or end ctx: then the request is cancelled and
// the channel is closed without a Final item (ctx.Err() says why). A goroutine forwards
// the responses until one of the two happens.
func (s *Server) Stream(ctx context.Context, req *Request) (<-chan StreamItem, error) {
	st := newResponseStream(s, ctx)
	if err := st.send(req); err != nil {
		return nil, err
	}
	st.seal()
	go st.forward()
	return st.out, nil
}

// Sequence sends the requests of one sequence (one correlation ID) of a stateful model,
// in order, and delivers all their responses, in order, on one channel. The first
// request sent is flagged SequenceStart and the one given to End SequenceEnd. Its
// methods may be called from any goroutine; requests are sent in the order of the calls.
type Sequence struct {
	stream *responseStream
	mark   func(req *Request) error // sets the correlation ID

	mu      sync.Mutex
	started bool
}

// NewSequence starts a sequence with a numeric correlation ID (not 0). Its responses
// arrive on Responses until the END request's FINAL, Close, or the end of ctx, which
// cancels the requests in flight.
func (s *Server) NewSequence(ctx context.Context, correlationID uint64) (*Sequence, error) {
	if correlationID == 0 {
		return nil, newError(InvalidArgument, "a sequence needs a correlation ID other than 0")
	}
	return s.newSequence(ctx, func(req *Request) error { return req.SetCorrelationID(correlationID) })
}

// NewSequenceString is NewSequence with a string correlation ID (1 to 128 bytes).
func (s *Server) NewSequenceString(ctx context.Context, correlationID string) (*Sequence, error) {
	if correlationID == "" {
		return nil, newError(InvalidArgument, "a sequence needs a non-empty correlation ID")
	}
	return s.newSequence(ctx, func(req *Request) error { return req.SetCorrelationIDString(correlationID) })
}

func (s *Server) newSequence(ctx context.Context, mark func(req *Request) error) (*Sequence, error) {
	if ctx.Err() != nil {
		return nil, contextError(ctx)
	}
	if err := s.use(func(*C.infer_server) error { return nil }); err != nil {
		return nil, err
	}
	q := &Sequence{stream: newResponseStream(s, ctx), mark: mark}
	go q.stream.forward()
	return q, nil
}

// Responses returns the channel of the sequence's responses: StreamItem.Final marks the
// last response of each request. It is closed after the FINAL of the last request once
// End or Close was called, or when the context ends. Receive until it is closed.
func (q *Sequence) Responses() <-chan StreamItem { return q.stream.out }

// Send sends the next request of the sequence (consuming it).
func (q *Sequence) Send(req *Request) error { return q.send(req, 0) }

// End sends the last request of the sequence (consuming it); nothing can be sent after.
func (q *Sequence) End(req *Request) error {
	err := q.send(req, SequenceEnd)
	q.stream.seal()
	return err
}

func (q *Sequence) send(req *Request, flags RequestFlags) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if !q.started {
		flags |= SequenceStart
	}
	if err := q.mark(req); err != nil {
		req.Close()
		return err
	}
	if err := req.SetFlags(flags); err != nil {
		req.Close()
		return err
	}
	if err := q.stream.send(req); err != nil {
		return err
	}
	q.started = true
	return nil
}

// Close ends sending without an END request: Responses closes once the requests sent
// have had their FINAL. The model keeps the sequence until its idle timeout. Calling it
// again, or after End, does nothing.
func (q *Sequence) Close() error {
	q.stream.seal()
	return nil
}
