// Command streaming streams tokens from the generative model of the shipped repository,
// tiny_gpt2 (a GPT-2 with a vocabulary of 256 tokens, context 128 and random weights, so
// the text is gibberish: token ids are printed as bytes), served with in-flight batching:
//
//  1. Four prompts are streamed at once (max_tokens 40, 60, 80, 100), each on its own
//     channel from Server.Stream; every token is printed as it arrives, prefixed by its
//     request. An iteration statistics callback counts the scheduler's iterations and
//     records the largest batch.
//  2. When the longest request has 10 tokens, the main goroutine cancels it by its
//     request id: it stops after the current iteration and its FINAL response is
//     Cancelled with finish_reason "cancelled". The others end with "length" after
//     exactly max_tokens tokens.
//  3. A greedy request (not streamed: one response) run twice gives the same tokens.
//
// It exits with status 1 on any error or wrong answer.
//
//	cd bindings/go && go run ./cmd/streaming [-models ../../models]
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	infer "libinfer/bindings/go"
)

const (
	model       = "tiny_gpt2"
	cancelAfter = 10 // tokens of the longest request before it is cancelled
)

// generation is one streaming request and, once it has ended, what it received.
type generation struct {
	name      string
	prompt    string
	maxTokens int64
	sampled   bool // temperature, top_k, top_p and a seed instead of greedy decoding

	tokens []int32
	final  bool   // the FINAL response came
	err    error  // the request's status: nil, or an *infer.Error (Cancelled, ...)
	reason string // finish_reason: "length", "end_id", "cancelled" or "error"
	// The FINAL's counts.
	promptTokens, generatedTokens, cachedTokens int64
}

func main() {
	models := flag.String("models", filepath.Join("..", "..", "models"), "the model repository holding tiny_gpt2")
	flag.Parse()
	if err := run(*models); err != nil {
		log.Fatal(err)
	}
}

func run(models string) error {
	server, err := infer.NewServer(&infer.ServerOptions{
		ModelRepository:      models,
		ExplicitModelControl: true,
		StartupModels:        []string{model}, // only this one
		GPU:                  infer.GPUOff,
	})
	if err != nil {
		return err
	}
	defer server.Close()
	fmt.Printf("serving %s from %s\n", model, models)

	// Runs on the model's generation thread after every iteration: keep it short.
	var iterations, maxActive atomic.Int64
	err = server.SetIterationStatsCallback(model, func(text string) {
		var it struct {
			ActiveRequests int64 `json:"active_requests"`
		}
		if json.Unmarshal([]byte(text), &it) != nil {
			return
		}
		iterations.Add(1)
		for m := maxActive.Load(); it.ActiveRequests > m && !maxActive.CompareAndSwap(m, it.ActiveRequests); m = maxActive.Load() {
		}
	})
	if err != nil {
		return err
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := streamFourPrompts(ctx, server); err != nil {
		return err
	}
	// nil clears it; once this returns the function is not running and never runs again.
	if err := server.SetIterationStatsCallback(model, nil); err != nil {
		return err
	}
	fmt.Printf("%d iterations, largest batch %d requests\n", iterations.Load(), maxActive.Load())
	if maxActive.Load() < 2 {
		return fmt.Errorf("wrong answer: the requests never shared an iteration")
	}

	if err := greedyTwice(ctx, server); err != nil {
		return err
	}
	stats, err := server.StatisticsJSON(model)
	if err != nil {
		return err
	}
	fmt.Printf("statistics of %s: %s\n", model, stats)
	fmt.Println("all answers checked")
	return nil
}

// newRequest asks for maxTokens tokens after prompt (one token per byte).
func newRequest(server *infer.Server, prompt string, maxTokens int64) (*infer.Request, error) {
	ids := make([]int32, len(prompt))
	for i := 0; i < len(prompt); i++ {
		ids[i] = int32(prompt[i])
	}
	req, err := server.NewRequest(model, infer.LatestVersion)
	if err != nil {
		return nil, err
	}
	err = req.AddInputInt32("input_ids", []int64{int64(len(ids))}, ids)
	if err == nil {
		err = req.SetParameterInt("max_tokens", maxTokens)
	}
	if err != nil {
		req.Close()
		return nil, err
	}
	return req, nil
}

func streamFourPrompts(ctx context.Context, server *infer.Server) error {
	gens := []*generation{
		{name: "A", prompt: "Once upon a time", maxTokens: 40},
		{name: "B", prompt: "The quick brown fox", maxTokens: 60},
		{name: "C", prompt: "In-flight batching", maxTokens: 80, sampled: true},
		{name: "D", prompt: "Hello, GPT-2!", maxTokens: 100},
	}
	longest := gens[len(gens)-1]
	fmt.Printf("streaming %d requests (max_tokens 40, 60, 80, 100); %s is cancelled after %d tokens\n",
		len(gens), longest.name, cancelAfter)

	// The receiving goroutines print concurrently: one lock keeps the lines whole.
	var printMu sync.Mutex
	printf := func(format string, args ...interface{}) {
		printMu.Lock()
		fmt.Printf(format, args...)
		printMu.Unlock()
	}
	longestID := make(chan uint64, 1) // the longest request's id, once it has enough tokens

	start := time.Now()
	var wg sync.WaitGroup
	for _, g := range gens {
		req, err := newRequest(server, g.prompt, g.maxTokens)
		if err == nil {
			err = req.SetParameterBool("streaming", true)
		}
		if err == nil && g.sampled {
			err = setSampling(req)
		}
		if err != nil {
			req.Close()
			return err
		}
		extra := ""
		if g.sampled {
			extra = " (temperature 0.8, top_k 40, top_p 0.95, seed 7)"
		}
		printf("  %s  prompt %q%s\n", g.name, g.prompt, extra)
		responses, err := server.Stream(ctx, req)
		if err != nil {
			return err
		}
		var notify chan<- uint64
		if g == longest {
			notify = longestID
		}
		wg.Add(1)
		go func(g *generation, responses <-chan infer.StreamItem) {
			defer wg.Done()
			receive(g, responses, printf, notify)
		}(g, responses)
	}

	// Cancel by request id: the request stops after the current iteration and still
	// sends its FINAL. (Ending the Stream's context would cancel it too, but close the
	// channel without a FINAL.)
	select {
	case id := <-longestID:
		printf("  %s  cancelling after %d tokens\n", longest.name, cancelAfter)
		if err := server.Cancel(id); err != nil {
			return fmt.Errorf("cancel %s: %w", longest.name, err)
		}
	case <-ctx.Done():
	}
	wg.Wait()
	seconds := time.Since(start).Seconds()

	fmt.Println()
	total := 0
	for _, g := range gens {
		total += len(g.tokens)
		fmt.Printf("%s: %q -> \"%s\"\n   %s, finish_reason %s, prompt_tokens %d, generated_tokens %d, cached_tokens %d\n",
			g.name, g.prompt, text(g.tokens), status(g.err), g.reason, g.promptTokens, g.generatedTokens, g.cachedTokens)
		if err := check(g, g == longest); err != nil {
			return fmt.Errorf("wrong answer: %s: %w", g.name, err)
		}
	}
	fmt.Printf("%d tokens in %.3f s: %.0f tokens/s\n", total, seconds, float64(total)/seconds)
	return nil
}

// setSampling asks for reproducible sampling instead of greedy decoding.
func setSampling(req *infer.Request) error {
	if err := req.SetParameterFloat("temperature", 0.8); err != nil {
		return err
	}
	if err := req.SetParameterInt("top_k", 40); err != nil {
		return err
	}
	if err := req.SetParameterFloat("top_p", 0.95); err != nil {
		return err
	}
	return req.SetParameterInt("seed", 7)
}

// receive reads one request's responses until its channel closes, printing each token
// as it arrives. When notify is set, it gets the request's id after cancelAfter tokens.
func receive(g *generation, responses <-chan infer.StreamItem, printf func(string, ...interface{}), notify chan<- uint64) {
	for item := range responses {
		resp := item.Response
		// One token per response; none in a FINAL that a cancel or end_id ended, and no
		// output_ids at all in a failed one.
		ids, _, err := resp.OutputInt32("output_ids")
		if err != nil && infer.CodeOf(err) != infer.NotFound {
			g.err = err
		}
		for _, id := range ids {
			g.tokens = append(g.tokens, id)
			printf("  %s  token %3d: %3d '%s'\n", g.name, len(g.tokens), id, text([]int32{id}))
		}
		if notify != nil && len(g.tokens) >= cancelAfter {
			notify <- resp.RequestID() // every response carries its request's id
			notify = nil
		}
		if item.Final {
			g.final = true
			if g.err == nil {
				g.err = item.Err
			}
			g.reason, _ = resp.ParameterString("finish_reason")
			g.promptTokens, _ = resp.ParameterInt("prompt_tokens")
			g.generatedTokens, _ = resp.ParameterInt("generated_tokens")
			g.cachedTokens, _ = resp.ParameterInt("cached_tokens")
			printf("  %s  FINAL %s, finish_reason %q, %d tokens\n", g.name, status(item.Err), g.reason, len(g.tokens))
		}
		resp.Close()
	}
}

// check says what is wrong with a finished generation, if anything.
func check(g *generation, cancelled bool) error {
	switch {
	case !g.final:
		return fmt.Errorf("no FINAL response")
	case g.promptTokens != int64(len(g.prompt)):
		return fmt.Errorf("prompt_tokens %d, sent %d", g.promptTokens, len(g.prompt))
	case g.generatedTokens != int64(len(g.tokens)):
		return fmt.Errorf("generated_tokens %d, received %d", g.generatedTokens, len(g.tokens))
	case cancelled && (infer.CodeOf(g.err) != infer.Cancelled || g.reason != "cancelled"):
		return fmt.Errorf("ended %s / %q, want CANCELLED / \"cancelled\"", status(g.err), g.reason)
	case cancelled && (len(g.tokens) < cancelAfter || int64(len(g.tokens)) >= g.maxTokens):
		return fmt.Errorf("%d tokens, want %d..%d", len(g.tokens), cancelAfter, g.maxTokens-1)
	case !cancelled && (g.err != nil || g.reason != "length"):
		return fmt.Errorf("ended %s / %q, want OK / \"length\"", status(g.err), g.reason)
	case !cancelled && int64(len(g.tokens)) != g.maxTokens:
		return fmt.Errorf("%d tokens, want max_tokens = %d", len(g.tokens), g.maxTokens)
	}
	return nil
}

// greedyTwice runs one greedy request twice without streaming (one response each).
func greedyTwice(ctx context.Context, server *infer.Server) error {
	const prompt = "The same prompt, twice: " // 24 tokens: one block of 16 to reuse
	var runs [2][]int32
	var cached [2]int64
	for i := range runs {
		req, err := newRequest(server, prompt, 32)
		if err != nil {
			return err
		}
		resp, err := server.Infer(ctx, req)
		if err != nil {
			return err
		}
		runs[i], _, err = resp.OutputInt32("output_ids")
		cached[i], _ = resp.ParameterInt("cached_tokens")
		resp.Close()
		if err != nil {
			return err
		}
	}
	fmt.Printf("greedy %q twice -> \"%s\" (%d tokens; cached prompt tokens %d, then %d)\n",
		prompt, text(runs[0]), len(runs[0]), cached[0], cached[1])
	if len(runs[0]) != 32 || text(runs[0]) != text(runs[1]) {
		return fmt.Errorf("wrong answer: two greedy runs of one prompt differ: %v and %v", runs[0], runs[1])
	}
	return nil
}

// text shows token ids as bytes: printable ASCII as itself, anything else as \xNN.
func text(tokens []int32) string {
	var b strings.Builder
	for _, t := range tokens {
		if t >= 0x20 && t < 0x7f && t != '\\' {
			b.WriteByte(byte(t))
		} else {
			fmt.Fprintf(&b, `\x%02x`, t&0xff)
		}
	}
	return b.String()
}

// status names a request's outcome: OK or the error's code.
func status(err error) string {
	if err == nil {
		return "OK"
	}
	return infer.CodeOf(err).String()
}
