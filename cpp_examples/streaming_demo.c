/* Token streaming from a generative model with in-flight batching: the tiny GPT-2 of the
 * shipped repository (models/tiny_gpt2: vocabulary of 256 tokens, context 128, random
 * weights, so the text is gibberish; token ids are printed as bytes).
 *
 *   1. Four prompts are sent at once as streaming requests (max_tokens 40, 60, 80, 100).
 *      The model batches them per iteration: requests join and leave the running batch
 *      as they start and finish. Each token is printed as it arrives, prefixed by its
 *      request; an iteration statistics callback counts the iterations and records the
 *      largest batch.
 *   2. When the longest request has 10 tokens, the main thread cancels it: it stops after
 *      the current iteration, with status CANCELLED and finish_reason "cancelled". The
 *      others end with finish_reason "length" after exactly max_tokens tokens.
 *   3. A greedy (non-streaming) request run twice gives the same tokens.
 *
 * Usage: streaming_demo [path/to/models]   (default: the repository this was built from)
 * Exits 1 on any error or wrong answer. */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "infer.h"

#ifndef INFER_MODELS_DIR
#define INFER_MODELS_DIR "models"
#endif

#define MODEL "tiny_gpt2"
#define REQUESTS 4
#define CANCEL_AFTER 10 /* tokens of the longest request before it is cancelled */
#define MAX_TOKENS 128  /* the model's context: no request generates more */

#define TRY(call)                                                                   \
    do {                                                                            \
        if ((call) != INFER_STATUS_OK) {                                            \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call,    \
                    infer_last_error_message());                                    \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

static void fail(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    fprintf(stderr, "wrong answer: ");
    vfprintf(stderr, fmt, args);
    fprintf(stderr, "\n");
    va_end(args);
    exit(1);
}

/* One generation request and what its responses brought. The response callback runs on
 * a library thread, so everything below `id` is guarded by `lock` (which also keeps the
 * printed lines whole); `id` is written and read by the main thread only. */
struct generation {
    char name;            /* 'A', 'B', ...: the prefix of its printed lines */
    const char *prompt;   /* ASCII text, sent as one token per byte */
    int64_t max_tokens;
    uint64_t id;          /* from infer_server_enqueue, for infer_server_cancel */

    int32_t tokens[MAX_TOKENS];
    int count;
    int finished;         /* the FINAL response came */
    infer_status status;  /* of the FINAL response */
    char finish_reason[16];
    int64_t prompt_tokens, generated_tokens, cached_tokens;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER; /* a token or a FINAL came */

/* What the iteration statistics callback saw (it also runs on a library thread). */
static struct {
    pthread_mutex_t lock;
    long iterations;
    long max_active;
} iterations = {PTHREAD_MUTEX_INITIALIZER, 0, 0};

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* A token id as text: the byte itself when it is printable ASCII, else \xNN. */
static void print_token(int32_t token) {
    if (token >= 0x20 && token < 0x7f && token != '\\')
        putchar((char)token);
    else
        printf("\\x%02x", (unsigned)token & 0xff);
}

static void print_tokens(const int32_t *tokens, int count) {
    for (int i = 0; i < count; i++) print_token(tokens[i]);
}

/* The integer value of "key" in a flat JSON object such as the iteration statistics
 * (-1 when absent). */
static long json_int(const char *json, const char *key) {
    char quoted[64];
    snprintf(quoted, sizeof quoted, "\"%s\"", key);
    const char *at = strstr(json, quoted);
    if (at == NULL) return -1;
    at += strlen(quoted);
    while (*at == ' ' || *at == ':') at++;
    return strtol(at, NULL, 10);
}

/* Called after every scheduler iteration of the model, on its generation thread: keep it
 * short, it delays the next iteration. */
static void on_iteration(void *user_data, const char *json) {
    (void)user_data;
    long active = json_int(json, "active_requests");
    pthread_mutex_lock(&iterations.lock);
    iterations.iterations++;
    if (active > iterations.max_active) iterations.max_active = active;
    pthread_mutex_unlock(&iterations.lock);
}

/* Receives one response of a streaming request: a new token in `output_ids` (none in a
 * FINAL that end_id or a cancel ended, no outputs at all in a failed one), and on the
 * FINAL the finish reason and counts. */
static void on_response(void *user_data, infer_response *resp, uint32_t flags) {
    struct generation *g = user_data;
    const void *data = NULL;
    size_t bytes = 0;
    if (infer_response_output_by_name(resp, "output_ids", NULL, NULL, NULL, &data, &bytes) !=
        INFER_STATUS_OK)
        bytes = 0; /* an error response has no outputs */
    const int32_t *ids = data;

    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < bytes / sizeof *ids; i++) {
        if (g->count < MAX_TOKENS) g->tokens[g->count] = ids[i];
        g->count++;
        printf("  %c  token %3d: %3d '", g->name, g->count, (int)ids[i]);
        print_token(ids[i]);
        printf("'\n");
    }
    if (flags & INFER_RESPONSE_FLAG_FINAL) {
        const char *reason = "(none)";
        g->status = infer_response_status(resp);
        infer_response_parameter_string(resp, "finish_reason", &reason);
        snprintf(g->finish_reason, sizeof g->finish_reason, "%s", reason);
        infer_response_parameter_int(resp, "prompt_tokens", &g->prompt_tokens);
        infer_response_parameter_int(resp, "generated_tokens", &g->generated_tokens);
        infer_response_parameter_int(resp, "cached_tokens", &g->cached_tokens);
        g->finished = 1;
        printf("  %c  FINAL %s, finish_reason \"%s\", %d tokens\n", g->name,
               infer_status_string(g->status), g->finish_reason, g->count);
        if (g->status != INFER_STATUS_OK && g->status != INFER_STATUS_CANCELLED)
            printf("  %c  error: %s\n", g->name, infer_response_error_message(resp));
    }
    fflush(stdout);
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&lock);
    infer_response_free(resp);
}

/* A request for MODEL with `prompt` as its tokens, one byte each. */
static infer_request *generation_request(infer_server *s, const char *prompt,
                                         int64_t max_tokens) {
    int32_t ids[MAX_TOKENS];
    size_t n = strlen(prompt);
    if (n > MAX_TOKENS) n = MAX_TOKENS;
    for (size_t i = 0; i < n; i++) ids[i] = (unsigned char)prompt[i];
    const int64_t shape[1] = {(int64_t)n};
    infer_request *r;
    TRY(infer_request_new(s, MODEL, -1, &r));
    TRY(infer_request_add_input(r, "input_ids", INFER_DATATYPE_INT32, shape, 1, ids,
                                n * sizeof ids[0]));
    TRY(infer_request_set_parameter_int(r, "max_tokens", max_tokens));
    return r;
}

/* Waits (on the main thread) until `done(g)` holds for generation g. */
static void wait_for(struct generation *g, int (*done)(const struct generation *)) {
    pthread_mutex_lock(&lock);
    while (!done(g)) pthread_cond_wait(&changed, &lock);
    pthread_mutex_unlock(&lock);
}

static int has_enough_tokens(const struct generation *g) {
    return g->finished || g->count >= CANCEL_AFTER;
}

static int is_finished(const struct generation *g) { return g->finished; }

static void stream_four_prompts(infer_server *s) {
    static struct generation gens[REQUESTS] = {
        {.name = 'A', .prompt = "Once upon a time", .max_tokens = 40},
        {.name = 'B', .prompt = "The quick brown fox", .max_tokens = 60},
        {.name = 'C', .prompt = "In-flight batching", .max_tokens = 80},
        {.name = 'D', .prompt = "Hello, GPT-2!", .max_tokens = 100},
    };
    struct generation *longest = &gens[REQUESTS - 1];

    printf("streaming %d requests (max_tokens 40, 60, 80, 100); %c is cancelled after %d "
           "tokens\n",
           REQUESTS, longest->name, CANCEL_AFTER);
    double start = now_s();
    for (int i = 0; i < REQUESTS; i++) {
        struct generation *g = &gens[i];
        infer_request *r = generation_request(s, g->prompt, g->max_tokens);
        TRY(infer_request_set_parameter_bool(r, "streaming", true));
        if (g->name == 'C') { /* sampled instead of greedy, reproducibly */
            TRY(infer_request_set_parameter_double(r, "temperature", 0.8));
            TRY(infer_request_set_parameter_int(r, "top_k", 40));
            TRY(infer_request_set_parameter_double(r, "top_p", 0.95));
            TRY(infer_request_set_parameter_int(r, "seed", 7));
        }
        pthread_mutex_lock(&lock);
        printf("  %c  prompt \"%s\"%s\n", g->name, g->prompt,
               g->name == 'C' ? " (temperature 0.8, top_k 40, top_p 0.95, seed 7)" : "");
        pthread_mutex_unlock(&lock);
        /* Takes the request; on_response may run before this returns. */
        TRY(infer_server_enqueue(s, r, on_response, g, &g->id));
    }

    /* Cancel from here, not from the callback: infer_server_cancel may deliver the FINAL
     * on the calling thread, and the callback holds `lock`. */
    wait_for(longest, has_enough_tokens);
    pthread_mutex_lock(&lock);
    printf("  %c  cancelling after %d tokens\n", longest->name, longest->count);
    pthread_mutex_unlock(&lock);
    TRY(infer_server_cancel(s, longest->id));

    for (int i = 0; i < REQUESTS; i++) wait_for(&gens[i], is_finished);
    double seconds = now_s() - start;

    int total = 0;
    printf("\n");
    for (int i = 0; i < REQUESTS; i++) {
        struct generation *g = &gens[i];
        total += g->count;
        printf("%c: \"%s\" -> \"", g->name, g->prompt);
        print_tokens(g->tokens, g->count < MAX_TOKENS ? g->count : MAX_TOKENS);
        printf("\"\n   %s, finish_reason %s, prompt_tokens %lld, generated_tokens %lld, "
               "cached_tokens %lld\n",
               infer_status_string(g->status), g->finish_reason, (long long)g->prompt_tokens,
               (long long)g->generated_tokens, (long long)g->cached_tokens);
        if (g->prompt_tokens != (int64_t)strlen(g->prompt))
            fail("%c: prompt_tokens %lld, sent %zu", g->name, (long long)g->prompt_tokens,
                 strlen(g->prompt));
        if (g->generated_tokens != g->count)
            fail("%c: generated_tokens %lld, received %d", g->name,
                 (long long)g->generated_tokens, g->count);
        if (g == longest) {
            if (g->status != INFER_STATUS_CANCELLED || strcmp(g->finish_reason, "cancelled") != 0)
                fail("%c: cancelled request ended %s / \"%s\"", g->name,
                     infer_status_string(g->status), g->finish_reason);
            if (g->count < CANCEL_AFTER || g->count >= g->max_tokens)
                fail("%c: cancelled after %d tokens, want %d..%lld", g->name, g->count,
                     CANCEL_AFTER, (long long)g->max_tokens - 1);
        } else {
            if (g->status != INFER_STATUS_OK || strcmp(g->finish_reason, "length") != 0)
                fail("%c: ended %s / \"%s\", want OK / \"length\"", g->name,
                     infer_status_string(g->status), g->finish_reason);
            if (g->count != g->max_tokens)
                fail("%c: %d tokens, want max_tokens = %lld", g->name, g->count,
                     (long long)g->max_tokens);
        }
    }
    printf("%d tokens in %.3f s: %.0f tokens/s\n", total, seconds, total / seconds);
}

/* Runs a greedy request without streaming: one FINAL response with every token.
 * `*cached` is how many prompt tokens the KV cache already held (whole blocks of 16
 * tokens reused from an earlier request with the same prefix). */
static int greedy(infer_server *s, const char *prompt, int32_t *tokens, int64_t *cached) {
    infer_request *r = generation_request(s, prompt, 32);
    infer_response *resp;
    TRY(infer_server_infer(s, r, &resp));
    if (infer_response_status(resp) != INFER_STATUS_OK)
        fail("greedy request: %s", infer_response_error_message(resp));
    const void *ids;
    size_t bytes;
    TRY(infer_response_output_by_name(resp, "output_ids", NULL, NULL, NULL, &ids, &bytes));
    int n = (int)(bytes / sizeof *tokens);
    if (n > MAX_TOKENS) fail("greedy request: %d tokens", n);
    memcpy(tokens, ids, bytes);
    TRY(infer_response_parameter_int(resp, "cached_tokens", cached));
    infer_response_free(resp);
    return n;
}

static void greedy_twice(infer_server *s) {
    const char *prompt = "The same prompt, twice: "; /* 24 tokens: one block to reuse */
    int32_t first[MAX_TOKENS], second[MAX_TOKENS];
    int64_t cached_first, cached_second;
    int n1 = greedy(s, prompt, first, &cached_first);
    int n2 = greedy(s, prompt, second, &cached_second);
    printf("greedy \"%s\" twice -> \"", prompt);
    print_tokens(first, n1);
    printf("\" (%d tokens; cached prompt tokens %lld, then %lld)\n", n1,
           (long long)cached_first, (long long)cached_second);
    if (n1 != 32 || n2 != n1 || memcmp(first, second, (size_t)n1 * sizeof first[0]) != 0)
        fail("two greedy runs of one prompt differ");
}

int main(int argc, char **argv) {
    const char *repo = argc > 1 ? argv[1] : INFER_MODELS_DIR;
    infer_server_options *opts;
    TRY(infer_server_options_new(&opts));
    TRY(infer_server_options_set_model_repository(opts, repo));
    TRY(infer_server_options_set_model_control_explicit(opts, true));
    TRY(infer_server_options_add_startup_model(opts, MODEL)); /* only this one */
    infer_server *s;
    TRY(infer_server_new(opts, &s));
    infer_server_options_free(opts);
    printf("serving %s from %s\n", MODEL, repo);

    TRY(infer_server_set_iteration_stats_callback(s, MODEL, on_iteration, NULL));
    stream_four_prompts(s);
    /* NULL clears it; once this returns the callback is not running and never runs again. */
    TRY(infer_server_set_iteration_stats_callback(s, MODEL, NULL, NULL));
    printf("%ld iterations, largest batch %ld requests\n", iterations.iterations,
           iterations.max_active);
    if (iterations.max_active < 2) fail("the requests never shared an iteration");

    greedy_twice(s);

    char *stats;
    TRY(infer_server_statistics_json(s, MODEL, &stats));
    printf("statistics of %s: %s\n", MODEL, stats);
    infer_string_free(stats);
    TRY(infer_server_shutdown(s, 5000));
    infer_server_free(s);
    printf("all answers checked\n");
    return 0;
}
