package infer

import (
	"context"
	"encoding/json"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// The generative model of the shipped repository: a tiny GPT-2 (vocabulary 256,
// context 128) served with in-flight batching.
const gpt2Model = "tiny_gpt2"

// newGPT2Server serves only tiny_gpt2 from the shipped repository; cleanup closes it and
// checks that nothing was left behind.
func newGPT2Server(t *testing.T) *Server {
	t.Helper()
	before := runtime.NumGoroutine()
	s, err := NewServer(&ServerOptions{
		ModelRepository:      repository,
		ExplicitModelControl: true,
		StartupModels:        []string{gpt2Model},
		GPU:                  GPUOff,
	})
	if err != nil {
		t.Fatalf("NewServer: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		checkNothingLeft(t, before)
	})
	return s
}

// gpt2Request asks for maxTokens tokens after prompt, streamed one per response or not.
func gpt2Request(t *testing.T, s *Server, prompt []int32, maxTokens int64, streaming bool) *Request {
	t.Helper()
	req, err := s.NewRequest(gpt2Model, LatestVersion)
	if err != nil {
		t.Fatalf("NewRequest: %v", err)
	}
	if err := req.AddInputInt32("input_ids", []int64{int64(len(prompt))}, prompt); err != nil {
		t.Fatalf("AddInput: %v", err)
	}
	if err := req.SetParameterInt("max_tokens", maxTokens); err != nil {
		t.Fatal(err)
	}
	if err := req.SetParameterBool("streaming", streaming); err != nil {
		t.Fatal(err)
	}
	return req
}

// tokensOf returns the tokens of one response: none when it has no output_ids (an
// error or cancelled FINAL).
func tokensOf(t *testing.T, resp *Response) []int32 {
	t.Helper()
	if resp.Err() != nil {
		return nil
	}
	ids, _, err := resp.OutputInt32("output_ids")
	if err != nil {
		t.Fatalf("output_ids: %v", err)
	}
	return ids
}

func TestGenerativeStreamingSendsOneTokenPerResponse(t *testing.T) {
	s := newGPT2Server(t)
	prompt := []int32{'H', 'e', 'l', 'l', 'o'}
	ch, err := s.Stream(context.Background(), gpt2Request(t, s, prompt, 12, true))
	if err != nil {
		t.Fatal(err)
	}
	var streamed []int32
	responses := 0
	for item := range ch {
		responses++
		if item.Err != nil {
			t.Fatalf("response %d: %v", responses, item.Err)
		}
		ids := tokensOf(t, item.Response)
		if len(ids) != 1 {
			t.Errorf("response %d carries %d tokens, want 1", responses, len(ids))
		}
		streamed = append(streamed, ids...)
		if item.Final {
			reason, err := item.Response.ParameterString("finish_reason")
			if err != nil || reason != "length" {
				t.Errorf("finish_reason %q (%v), want length", reason, err)
			}
			for key, want := range map[string]int64{"prompt_tokens": 5, "generated_tokens": 12} {
				if got, err := item.Response.ParameterInt(key); err != nil || got != want {
					t.Errorf("%s = %d (%v), want %d", key, got, err, want)
				}
			}
		} else if _, err := item.Response.ParameterString("finish_reason"); CodeOf(err) != NotFound {
			t.Errorf("a non-final response has a finish_reason (%v)", err)
		}
		item.Response.Close()
	}
	if responses != 12 || len(streamed) != 12 {
		t.Fatalf("%d responses, %d tokens; want 12 of each", responses, len(streamed))
	}
	// Without streaming: one response with the same (greedy) tokens.
	resp, err := s.Infer(context.Background(), gpt2Request(t, s, prompt, 12, false))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Close()
	if all := tokensOf(t, resp); !equalInt32s(all, streamed) {
		t.Errorf("not streamed %v, streamed %v", all, streamed)
	}
}

func TestGenerativeCancelOneStreamByItsRequestID(t *testing.T) {
	s := newGPT2Server(t)
	short, err := s.Stream(context.Background(), gpt2Request(t, s, []int32{8, 9}, 20, true))
	if err != nil {
		t.Fatal(err)
	}
	// The cancel is sent from the callback of the fifth token: the callbacks of a
	// generative model run on its loop between iterations, so the request is certainly
	// still running then, however fast the model is. (A receiver that cancels after
	// reading a stream's fifth item may find all 100 tokens made already.)
	type event struct {
		tokens []int32
		final  bool
		err    error
		reason string
		cancel error
	}
	events := make(chan event, 128)
	var made atomic.Int64 // tokens received by the callback
	id, err := s.Enqueue(gpt2Request(t, s, []int32{5, 6, 7}, 100, true), func(resp *Response, final bool) {
		defer resp.Close()
		e := event{final: final, err: resp.Err()}
		if e.err == nil {
			e.tokens, _, _ = resp.OutputInt32("output_ids")
		}
		if made.Add(int64(len(e.tokens))) == 5 && !final {
			// Any response of a request carries its id; the request stops after the
			// current iteration and still ends with a FINAL.
			e.cancel = s.Cancel(resp.RequestID())
		}
		if final {
			e.reason, _ = resp.ParameterString("finish_reason")
		}
		events <- e
	})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for e := range events {
		n += len(e.tokens)
		if e.cancel != nil {
			t.Errorf("Cancel from the callback of token %d: %v", n, e.cancel)
		}
		if !e.final {
			continue
		}
		wantCode(t, e.err, Cancelled)
		if e.reason != "cancelled" {
			t.Errorf("finish_reason %q, want cancelled", e.reason)
		}
		break
	}
	if n < 5 || n >= 100 {
		t.Errorf("%d tokens after a cancel at 5", n)
	}
	if err := s.Cancel(id); CodeOf(err) != NotFound {
		t.Errorf("Cancel of the finished request: %v", err)
	}
	// The other request of the batch is not disturbed.
	n = 0
	for item := range short {
		if item.Err != nil {
			t.Errorf("other request: %v", item.Err)
		}
		n += len(tokensOf(t, item.Response))
		item.Response.Close()
	}
	if n != 20 {
		t.Errorf("other request: %d tokens, want 20", n)
	}
}

// iterationStats are the fields of the iteration statistics this test reads.
type iterationStats struct {
	Iteration          int64 `json:"iteration"`
	ActiveRequests     int64 `json:"active_requests"`
	ContextTokens      int64 `json:"context_tokens"`
	GenerationRequests int64 `json:"generation_requests"`
	KVBlocksUsed       int64 `json:"kv_blocks_used"`
}

func TestIterationStatsCallback(t *testing.T) {
	s := newGPT2Server(t)
	var mu sync.Mutex
	var first, second []iterationStats
	collect := func(into *[]iterationStats) func(string) {
		return func(text string) {
			var v iterationStats
			if err := json.Unmarshal([]byte(text), &v); err != nil {
				t.Errorf("%v: %s", err, text)
			}
			mu.Lock()
			*into = append(*into, v)
			mu.Unlock()
		}
	}
	run := func(prompt []int32, maxTokens int64) {
		t.Helper()
		resp, err := s.Infer(context.Background(), gpt2Request(t, s, prompt, maxTokens, false))
		if err != nil {
			t.Fatal(err)
		}
		resp.Close()
	}

	if err := s.SetIterationStatsCallback(gpt2Model, collect(&first)); err != nil {
		t.Fatal(err)
	}
	run([]int32{1, 2, 3, 4, 5}, 6)
	// Replacing: the first function is never called again once this returns.
	if err := s.SetIterationStatsCallback(gpt2Model, collect(&second)); err != nil {
		t.Fatal(err)
	}
	run([]int32{1}, 3)
	if err := s.SetIterationStatsCallback(gpt2Model, nil); err != nil {
		t.Fatal(err)
	}
	run([]int32{2}, 4)

	mu.Lock()
	defer mu.Unlock()
	if len(first) != 6 || len(second) != 3 {
		t.Fatalf("%d and %d iterations seen, want 6 and 3", len(first), len(second))
	}
	if first[0].ContextTokens != 5 || first[0].ActiveRequests != 1 || first[1].GenerationRequests != 1 {
		t.Errorf("first iterations: %+v", first[:2])
	}
	if first[5].Iteration <= first[0].Iteration || second[0].Iteration <= first[5].Iteration {
		t.Errorf("iteration numbers do not increase: %+v %+v", first, second)
	}

	wantCode(t, s.SetIterationStatsCallback("no_such_model", func(string) {}), NotFound)
	if err := s.LoadModel("add_sub", addSubConfig, ""); err != nil {
		t.Fatal(err)
	}
	wantCode(t, s.SetIterationStatsCallback("add_sub", func(string) {}), InvalidArgument)
}

func TestIterationStatsCallbackSetAtClose(t *testing.T) {
	s := newGPT2Server(t)
	calls := make(chan struct{}, 1)
	if err := s.SetIterationStatsCallback(gpt2Model, func(string) {
		select {
		case calls <- struct{}{}:
		default:
		}
	}); err != nil {
		t.Fatal(err)
	}
	// Close with requests generating and the callback set: it drains them, then frees
	// the handle (the cleanup checks that no request is left).
	for i := int32(0); i < 4; i++ {
		if _, err := s.Enqueue(gpt2Request(t, s, []int32{i}, 50, true), func(resp *Response, final bool) {
			resp.Close()
		}); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case <-calls:
	case <-time.After(10 * time.Second):
		t.Fatal("no iteration reported")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if len(s.stats) != 0 {
		t.Errorf("%d statistics handles left after Close", len(s.stats))
	}
	wantCode(t, s.SetIterationStatsCallback(gpt2Model, nil), Unavailable)
}

func equalInt32s(a, b []int32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
