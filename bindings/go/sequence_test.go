package infer

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"
)

func accumulatorRequest(t *testing.T, s *Server, model string, v int64) *Request {
	t.Helper()
	req, err := s.NewRequest(model, LatestVersion)
	if err != nil {
		t.Fatalf("NewRequest: %v", err)
	}
	if err := req.AddInputInt64("INPUT", []int64{1, 1}, []int64{v}); err != nil {
		t.Fatalf("AddInput: %v", err)
	}
	return req
}

func TestSequenceWithFlagsByHand(t *testing.T) {
	s := newTestServer(t, map[string]string{"acc": accumulatorConfig})
	values := []int64{3, 4, -2, 10}
	var sum int64
	for i, v := range values {
		req := accumulatorRequest(t, s, "acc", v)
		var flags RequestFlags
		if i == 0 {
			flags |= SequenceStart
		}
		if i == len(values)-1 {
			flags |= SequenceEnd
		}
		if err := req.SetCorrelationID(77); err != nil {
			t.Fatal(err)
		}
		if err := req.SetFlags(flags); err != nil {
			t.Fatal(err)
		}
		resp, err := s.Infer(context.Background(), req)
		if err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		sum += v
		out, _, err := resp.OutputInt64("OUTPUT")
		if err != nil || len(out) != 1 || out[0] != sum || resp.CorrelationID() != 77 {
			t.Errorf("step %d: %v %v, correlation %d, want %d", i, out, err, resp.CorrelationID(), sum)
		}
		resp.Close()
	}

	// A new sequence without START names the model and the ID.
	req := accumulatorRequest(t, s, "acc", 1)
	if err := req.SetCorrelationID(4242); err != nil {
		t.Fatal(err)
	}
	_, err := s.Infer(context.Background(), req)
	if err == nil {
		t.Fatal("a first request without START succeeded")
	}
	wantCode(t, err, CodeOf(err), "4242")
	// No correlation ID at all.
	_, err = s.Infer(context.Background(), accumulatorRequest(t, s, "acc", 1))
	if err == nil {
		t.Error("a sequence request without an ID succeeded")
	}
}

func TestManySequencesAtOnce(t *testing.T) {
	s := newTestServer(t, map[string]string{"acc": accumulatorConfig})
	const sequences = 10 // 15 steps each, 4 slots: most wait in the backlog for a while
	var wg sync.WaitGroup
	errs := make(chan error, sequences)
	for q := 0; q < sequences; q++ {
		wg.Add(1)
		go func(q int) {
			defer wg.Done()
			errs <- runSequence(t, s, q)
		}(q)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
}

// runSequence sends all steps of sequence q at once (string ID for odd q), then checks
// the running sums in order.
func runSequence(t *testing.T, s *Server, q int) error {
	const steps = 15
	var seq *Sequence
	var err error
	if q%2 == 1 {
		seq, err = s.NewSequenceString(context.Background(), fmt.Sprintf("stream-%d", q))
	} else {
		seq, err = s.NewSequence(context.Background(), uint64(q+1))
	}
	if err != nil {
		return err
	}
	for i := 0; i < steps; i++ {
		req := accumulatorRequest(t, s, "acc", int64(q*100+i))
		if i == steps-1 {
			err = seq.End(req)
		} else {
			err = seq.Send(req)
		}
		if err != nil {
			seq.Close()
			for item := range seq.Responses() {
				item.Response.Close()
			}
			return fmt.Errorf("sequence %d step %d: %v", q, i, err)
		}
	}
	var sum int64
	i := 0
	var failure error
	for item := range seq.Responses() {
		sum += int64(q*100 + i)
		out, _, err := item.Response.OutputInt64("OUTPUT")
		item.Response.Close()
		if failure == nil && (item.Err != nil || !item.Final || err != nil || len(out) != 1 || out[0] != sum) {
			failure = fmt.Errorf("sequence %d step %d: %v (%v, %v), want %d", q, i, out, item.Err, err, sum)
		}
		i++
	}
	if failure == nil && i != steps {
		failure = fmt.Errorf("sequence %d: %d responses, want %d", q, i, steps)
	}
	if err := seq.Send(accumulatorRequest(t, s, "acc", 1)); failure == nil && CodeOf(err) != InvalidArgument {
		failure = fmt.Errorf("sequence %d: Send after End: %v", q, err)
	}
	return failure
}

func TestSequenceArgumentsAndClose(t *testing.T) {
	s := newTestServer(t, map[string]string{"acc": accumulatorConfig})
	if _, err := s.NewSequence(context.Background(), 0); CodeOf(err) != InvalidArgument {
		t.Errorf("ID 0: %v", err)
	}
	if _, err := s.NewSequenceString(context.Background(), ""); CodeOf(err) != InvalidArgument {
		t.Errorf("empty ID: %v", err)
	}
	seq, err := s.NewSequence(context.Background(), 9)
	if err != nil {
		t.Fatal(err)
	}
	if err := seq.Send(accumulatorRequest(t, s, "acc", 5)); err != nil {
		t.Fatal(err)
	}
	seq.Close()
	seq.Close()
	n := 0
	for item := range seq.Responses() {
		if item.Err != nil {
			t.Error(item.Err)
		}
		item.Response.Close()
		n++
	}
	if n != 1 {
		t.Errorf("%d responses after Close, want 1", n)
	}
	// A string ID longer than 128 bytes is refused when set.
	long, err := s.NewSequenceString(context.Background(), string(make([]byte, 200, 200)))
	if err == nil {
		err = long.Send(accumulatorRequest(t, s, "acc", 1))
		long.Close()
		for item := range long.Responses() {
			item.Response.Close()
		}
	}
	if err == nil {
		t.Error("a 200-byte ID was accepted")
	}
}

func TestSequenceContextCancel(t *testing.T) {
	slowAcc := strings.Replace(accumulatorConfig, `string_value: "200"`, `string_value: "500000"`, 1)
	s := newTestServer(t, map[string]string{"acc": slowAcc})
	ctx, cancel := context.WithCancel(context.Background())
	seq, err := s.NewSequence(ctx, 5)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 5; i++ {
		if err := seq.Send(accumulatorRequest(t, s, "acc", 1)); err != nil {
			t.Fatal(err)
		}
	}
	item := <-seq.Responses()
	if item.Err != nil {
		t.Errorf("first step: %v", item.Err)
	}
	item.Response.Close()
	cancel()
	start := time.Now()
	for item := range seq.Responses() {
		item.Response.Close() // at most one that raced with cancel
	}
	if time.Since(start) > 400*time.Millisecond {
		t.Error("the channel closed late")
	}
	if err := seq.Send(accumulatorRequest(t, s, "acc", 1)); CodeOf(err) != Cancelled {
		t.Errorf("Send after cancel: %v", err)
	}
}

// Each response callback sends the sequence's next request, as sequence_demo.c does.
func TestEnqueueFromTheCallback(t *testing.T) {
	s := newTestServer(t, map[string]string{"acc": accumulatorConfig})
	const steps = 6
	sums := make(chan int64, steps)
	failed := make(chan error, steps)
	var send func(step int)
	send = func(step int) {
		req, err := s.NewRequest("acc", LatestVersion)
		if err == nil {
			err = req.AddInputInt64("INPUT", []int64{1, 1}, []int64{int64(step)})
		}
		flags := RequestFlags(0)
		if step == 0 {
			flags |= SequenceStart
		}
		if step == steps-1 {
			flags |= SequenceEnd
		}
		if err == nil {
			err = req.SetCorrelationID(3)
		}
		if err == nil {
			err = req.SetFlags(flags)
		}
		if err == nil {
			_, err = s.Enqueue(req, func(resp *Response, final bool) {
				defer resp.Close()
				out, _, err := resp.OutputInt64("OUTPUT")
				if err != nil {
					failed <- err
					return
				}
				sums <- out[0]
				if final && step+1 < steps {
					send(step + 1)
				}
			})
		}
		if err != nil {
			req.Close()
			failed <- err
		}
	}
	send(0)
	var want int64
	for step := 0; step < steps; step++ {
		want += int64(step)
		select {
		case got := <-sums:
			if got != want {
				t.Errorf("step %d: sum %d, want %d", step, got, want)
			}
		case err := <-failed:
			t.Fatalf("step %d: %v", step, err)
		case <-time.After(10 * time.Second):
			t.Fatalf("step %d: no response", step)
		}
	}
}
