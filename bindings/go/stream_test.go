package infer

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestInferContextDeadlineCancelsTheQueuedRequest(t *testing.T) {
	s := newTestServer(t, map[string]string{"slow": slowConfig})
	// The first request occupies the only instance for 1 s.
	first := make(chan error, 1)
	go func() {
		resp, err := s.Infer(context.Background(), slowRequest(t, s, 1))
		if err == nil {
			resp.Close()
		}
		first <- err
	}()
	time.Sleep(30 * time.Millisecond)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	start := time.Now()
	resp, err := s.Infer(ctx, slowRequest(t, s, 2))
	elapsed := time.Since(start)
	if resp != nil {
		t.Fatal("a response came with the error")
	}
	wantCode(t, err, DeadlineExceeded)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("%v does not match context.DeadlineExceeded", err)
	}
	if elapsed > 600*time.Millisecond {
		t.Errorf("Infer returned %v after its 30 ms deadline", elapsed)
	}
	if err := <-first; err != nil {
		t.Errorf("first request: %v", err)
	}
	// The cancelled request never ran: one inference counted.
	text, _ := s.StatisticsJSON("slow")
	if want := `"inference_count":1,`; !containsCompact(text, want) {
		t.Errorf("statistics %s lack %s", text, want)
	}
}

// containsCompact looks for want in JSON text with its blanks removed.
func containsCompact(text, want string) bool {
	return strings.Contains(strings.NewReplacer(" ", "", "\n", "").Replace(text), want)
}

func TestInferCancelWhileExecutingDropsTheLateResult(t *testing.T) {
	s := newTestServer(t, map[string]string{"slow": slowConfig})
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		time.Sleep(50 * time.Millisecond) // the request is executing by then
		cancel()
	}()
	start := time.Now()
	_, err := s.Infer(ctx, slowRequest(t, s, 1))
	wantCode(t, err, Cancelled)
	if !errors.Is(err, context.Canceled) {
		t.Errorf("%v does not match context.Canceled", err)
	}
	if time.Since(start) > 600*time.Millisecond {
		t.Errorf("Infer waited for the execution after its context ended")
	}
	// Close drains: the late FINAL is freed by the callback (checked by the cleanup).
}

func TestInferWithAnEndedContextSendsNothing(t *testing.T) {
	s := newTestServer(t, map[string]string{"add_sub": addSubConfig})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	req := addSubRequest(t, s, []float32{1, 2, 3, 4}, []float32{1, 2, 3, 4})
	_, err := s.Infer(ctx, req)
	wantCode(t, err, Cancelled)
	if req.ptr != nil {
		t.Error("the request was not released")
	}
	if _, err := s.Stream(ctx, addSubRequest(t, s, []float32{1, 2, 3, 4}, []float32{1, 2, 3, 4})); CodeOf(err) != Cancelled {
		t.Errorf("Stream with an ended context: %v", err)
	}
}

func TestManyGoroutines(t *testing.T) {
	s := newTestServer(t, map[string]string{"add_sub": addSubConfig})
	const goroutines, perGoroutine = 32, 40
	var wg sync.WaitGroup
	errs := make(chan error, goroutines)
	for g := 0; g < goroutines; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < perGoroutine; i++ {
				x := float32(g*1000 + i)
				req := addSubRequest(t, s, []float32{x, x, x, x}, []float32{1, 2, 3, 4})
				var resp *Response
				var err error
				if i%2 == 0 {
					resp, err = s.Infer(context.Background(), req)
				} else {
					resp, err = streamOne(s, req)
				}
				if err != nil {
					errs <- err
					return
				}
				sum, _, err := resp.OutputFloat32("OUTPUT0")
				resp.Close()
				if err != nil || !equalFloats(sum, []float32{x + 1, x + 2, x + 3, x + 4}) {
					errs <- fmt.Errorf("goroutine %d request %d: %v %v", g, i, sum, err)
					return
				}
			}
		}(g)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	text, _ := s.StatisticsJSON("add_sub")
	if !containsCompact(text, fmt.Sprintf(`"inference_count":%d,`, goroutines*perGoroutine)) {
		t.Errorf("statistics: %s", text)
	}
}

// streamOne runs a request through Stream and returns its only response.
func streamOne(s *Server, req *Request) (*Response, error) {
	ch, err := s.Stream(context.Background(), req)
	if err != nil {
		return nil, err
	}
	var got []StreamItem
	for item := range ch {
		got = append(got, item)
	}
	if len(got) != 1 || !got[0].Final {
		for _, item := range got {
			item.Response.Close()
		}
		return nil, fmt.Errorf("stream gave %d items", len(got))
	}
	return got[0].Response, got[0].Err
}

func TestStreamDeliversErrorsAsItems(t *testing.T) {
	s := newTestServer(t, map[string]string{"add_sub": addSubConfig})
	if err := s.PauseModel("add_sub"); err != nil {
		t.Fatal(err)
	}
	req := addSubRequest(t, s, []float32{1, 2, 3, 4}, []float32{1, 2, 3, 4})
	if err := req.SetTimeout(10 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	ch, err := s.Stream(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	item, ok := <-ch
	if !ok || !item.Final || CodeOf(item.Err) != DeadlineExceeded || item.Response == nil {
		t.Fatalf("item %+v, open %v", item, ok)
	}
	if item.Response.RequestID() == 0 {
		t.Error("the error response has no request id")
	}
	item.Response.Close()
	if _, ok := <-ch; ok {
		t.Error("the channel stayed open after the FINAL")
	}
}

func TestStreamContextCancelClosesTheChannel(t *testing.T) {
	s := newTestServer(t, map[string]string{"slow": slowConfig})
	busy, err := s.Stream(context.Background(), slowRequest(t, s, 1))
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	ctx, cancel := context.WithCancel(context.Background())
	ch, err := s.Stream(ctx, slowRequest(t, s, 2))
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	start := time.Now()
	for item := range ch {
		t.Errorf("an item after cancel: %+v", item)
		item.Response.Close()
	}
	if time.Since(start) > 600*time.Millisecond {
		t.Error("the channel closed late")
	}
	// The busy request is not disturbed.
	item := <-busy
	if item.Err != nil || !item.Final {
		t.Errorf("busy request: %+v", item)
	}
	out, _, err := item.Response.OutputInt32("OUT")
	if err != nil || len(out) != 1 || out[0] != 1 {
		t.Errorf("busy output %v %v", out, err)
	}
	item.Response.Close()
	if _, ok := <-busy; ok {
		t.Error("busy stream still open")
	}
}

func TestEnqueueCallback(t *testing.T) {
	s := newTestServer(t, map[string]string{"add_sub": addSubConfig})
	done := make(chan []float32, 1)
	id, err := s.Enqueue(addSubRequest(t, s, []float32{1, 2, 3, 4}, []float32{4, 3, 2, 1}), func(resp *Response, final bool) {
		defer resp.Close()
		sum, _, _ := resp.OutputFloat32("OUTPUT0")
		if final {
			done <- sum
		}
	})
	if err != nil || id == 0 {
		t.Fatalf("Enqueue: %d %v", id, err)
	}
	if sum := <-done; !equalFloats(sum, []float32{5, 5, 5, 5}) {
		t.Errorf("sum %v", sum)
	}
	if _, err := s.Enqueue(addSubRequest(t, s, []float32{1, 2, 3, 4}, []float32{1, 2, 3, 4}), nil); CodeOf(err) != InvalidArgument {
		t.Errorf("nil callback: %v", err)
	}
}
