/*
 * An ensemble of three custom C backends, composed with `platform: "ensemble"`:
 *
 *   IMAGE (UINT8 [784], a 28x28 grey image)
 *     -> "preprocess"  (2 instances, one request per execution): FP32 [784], normalised
 *     -> "model"       (1 instance, dynamic batching up to 16): a fixed linear layer,
 *                      FP32 [10] class scores
 *     -> "postprocess" (dynamic batching, no queue delay): argmax, LABEL INT32 [1] and
 *                      SCORE FP32 [1]
 *
 * To the caller "classify" is one model: a request carries an image and its FINAL
 * response the label and score. The library sends each step as an ordinary request to
 * the composing model, so "model" batches the steps of many concurrent ensemble requests
 * with its own dynamic batcher.
 *
 * 4 client threads send 500 requests each without waiting (2000 in flight at most);
 * every response is checked against a reference computed here with the same arithmetic.
 * The program prints the throughput, how the two preprocess workers shared the work and
 * the executed batch sizes of "model", and exits non-zero on any wrong, failed or
 * missing result.
 */
#define _GNU_SOURCE 1

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "infer.h"

#define SIDE 28
#define PIXELS (SIDE * SIDE)
#define CLASSES 10
#define CLIENTS 4
#define PER_CLIENT 500
#define TOTAL (CLIENTS * PER_CLIENT)
#define PRE_WORKERS 2

/* ---- the arithmetic, shared by the backends and the reference ---- */

/* The linear layer's parameters; the "model" backend gets them as backend_user_data. */
struct linear_params {
    float w[CLASSES][PIXELS];
    float b[CLASSES];
};

static struct linear_params params;

static uint32_t rng_state = 12345u;

static uint32_t next_random(void) { /* xorshift32 */
    uint32_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    return rng_state = x;
}

static float normalise(uint8_t p) { return ((float)p / 255.0f - 0.5f) / 0.25f; }

static void linear_row(const struct linear_params *lp, const float *x, float *scores) {
    for (int c = 0; c < CLASSES; c++) {
        float acc = lp->b[c];
        for (int i = 0; i < PIXELS; i++) acc += lp->w[c][i] * x[i];
        scores[c] = acc;
    }
}

/* The first index of the largest score. */
static int32_t argmax_row(const float *scores, float *best) {
    int32_t k = 0;
    for (int32_t c = 1; c < CLASSES; c++)
        if (scores[c] > scores[k]) k = c;
    *best = scores[k];
    return k;
}

/* ---- backends ---- */

/* Reads batched input `name`, checking datatype and [rows, width]. */
static const void *batch_rows(infer_batch *b, const char *name, infer_datatype want, size_t width) {
    infer_datatype dt = 0;
    const int64_t *shape = NULL;
    size_t ndim = 0, bytes = 0;
    const void *data = NULL;
    uint32_t rows = infer_batch_size(b);
    if (infer_batch_input(b, name, &dt, &shape, &ndim, &data, &bytes) != INFER_STATUS_OK ||
        dt != want || ndim != 2 || shape[0] != (int64_t)rows || shape[1] != (int64_t)width ||
        bytes != rows * width * infer_datatype_byte_size(want)) {
        char msg[128];
        snprintf(msg, sizeof msg, "input '%s' missing or not %s [%u, %zu]", name,
                 infer_datatype_string(want), rows, width);
        infer_batch_set_error_message(b, msg);
        return NULL;
    }
    return data;
}

static void *batch_output(infer_batch *b, const char *name, size_t width) {
    int64_t shape[2] = {(int64_t)infer_batch_size(b), (int64_t)width};
    void *out = NULL;
    if (infer_batch_output(b, name, shape, 2, &out) != INFER_STATUS_OK) return NULL;
    return out;
}

/* preprocess: one state per instance, to show how the two workers share the work. */
struct pre_worker {
    atomic_uint executions;
    atomic_uint rows;
};

static struct pre_worker pre_workers[PRE_WORKERS];

static uint32_t pre_init(void *ud, const char *model, const char *config_json, uint32_t index,
                         int32_t gpu, void **state) {
    (void)ud, (void)model, (void)config_json, (void)gpu;
    if (index >= PRE_WORKERS) return INFER_STATUS_INVALID_ARGUMENT;
    *state = &pre_workers[index];
    return INFER_STATUS_OK;
}

static uint32_t pre_execute(void *state, infer_batch *b) {
    struct pre_worker *w = state;
    uint32_t rows = infer_batch_size(b);
    const uint8_t *in = batch_rows(b, "IMAGE", INFER_DATATYPE_UINT8, PIXELS);
    if (!in) return INFER_STATUS_INVALID_ARGUMENT;
    float *out = batch_output(b, "PIXELS", PIXELS);
    if (!out) return INFER_STATUS_INTERNAL;
    for (size_t i = 0; i < (size_t)rows * PIXELS; i++) out[i] = normalise(in[i]);
    atomic_fetch_add(&w->executions, 1);
    atomic_fetch_add(&w->rows, rows);
    return INFER_STATUS_OK;
}

/* model: the instance state is the shared, read-only parameters. */
static uint32_t linear_init(void *ud, const char *model, const char *config_json, uint32_t index,
                            int32_t gpu, void **state) {
    (void)model, (void)config_json, (void)index, (void)gpu;
    *state = ud;
    return INFER_STATUS_OK;
}

static uint32_t linear_execute(void *state, infer_batch *b) {
    const struct linear_params *lp = state;
    uint32_t rows = infer_batch_size(b);
    const float *in = batch_rows(b, "PIXELS", INFER_DATATYPE_FP32, PIXELS);
    if (!in) return INFER_STATUS_INVALID_ARGUMENT;
    float *out = batch_output(b, "SCORES", CLASSES);
    if (!out) return INFER_STATUS_INTERNAL;
    for (uint32_t r = 0; r < rows; r++) linear_row(lp, in + (size_t)r * PIXELS, out + (size_t)r * CLASSES);
    return INFER_STATUS_OK;
}

/* postprocess: stateless. */
static uint32_t argmax_execute(void *state, infer_batch *b) {
    (void)state;
    uint32_t rows = infer_batch_size(b);
    const float *in = batch_rows(b, "SCORES", INFER_DATATYPE_FP32, CLASSES);
    if (!in) return INFER_STATUS_INVALID_ARGUMENT;
    int32_t *label = batch_output(b, "LABEL", 1);
    float *score = batch_output(b, "SCORE", 1);
    if (!label || !score) return INFER_STATUS_INTERNAL;
    for (uint32_t r = 0; r < rows; r++) label[r] = argmax_row(in + (size_t)r * CLASSES, &score[r]);
    return INFER_STATUS_OK;
}

/* ---- configurations ---- */

static const char *PREPROCESS =
    "name: \"preprocess\" backend: \"c_preprocess\" max_batch_size: 16\n"
    "input [ { name: \"IMAGE\" data_type: TYPE_UINT8 dims: [ 784 ] } ]\n"
    "output [ { name: \"PIXELS\" data_type: TYPE_FP32 dims: [ 784 ] } ]\n"
    "instance_group [ { count: 2 kind: KIND_CPU } ]\n";

static const char *MODEL =
    "name: \"model\" backend: \"c_linear\" max_batch_size: 16\n"
    "input [ { name: \"PIXELS\" data_type: TYPE_FP32 dims: [ 784 ] } ]\n"
    "output [ { name: \"SCORES\" data_type: TYPE_FP32 dims: [ 10 ] } ]\n"
    "dynamic_batching { max_queue_delay_microseconds: 200 preferred_batch_size: [ 16 ] }\n";

static const char *POSTPROCESS =
    "name: \"postprocess\" backend: \"c_argmax\" max_batch_size: 16\n"
    "input [ { name: \"SCORES\" data_type: TYPE_FP32 dims: [ 10 ] } ]\n"
    "output [ { name: \"LABEL\" data_type: TYPE_INT32 dims: [ 1 ] },\n"
    "         { name: \"SCORE\" data_type: TYPE_FP32 dims: [ 1 ] } ]\n"
    "dynamic_batching { }\n";

static const char *CLASSIFY =
    "name: \"classify\" platform: \"ensemble\" max_batch_size: 16\n"
    "input [ { name: \"IMAGE\" data_type: TYPE_UINT8 dims: [ 784 ] } ]\n"
    "output [ { name: \"LABEL\" data_type: TYPE_INT32 dims: [ 1 ] },\n"
    "         { name: \"SCORE\" data_type: TYPE_FP32 dims: [ 1 ] } ]\n"
    "ensemble_scheduling { step [\n"
    "  { model_name: \"preprocess\" model_version: -1\n"
    "    input_map { key: \"IMAGE\" value: \"IMAGE\" }\n"
    "    output_map { key: \"PIXELS\" value: \"pixels\" } },\n"
    "  { model_name: \"model\" model_version: -1\n"
    "    input_map { key: \"PIXELS\" value: \"pixels\" }\n"
    "    output_map { key: \"SCORES\" value: \"scores\" } },\n"
    "  { model_name: \"postprocess\" model_version: -1\n"
    "    input_map { key: \"SCORES\" value: \"scores\" }\n"
    "    output_map { key: \"LABEL\" value: \"LABEL\" }\n"
    "    output_map { key: \"SCORE\" value: \"SCORE\" } }\n"
    "] }\n";

/* ---- requests ---- */

struct job {
    uint8_t image[PIXELS];
    int32_t want_label;
    float want_score;
    int32_t got_label;
    float got_score;
    atomic_int finals;
    int correct;
};

static struct job jobs[TOTAL];
static infer_server *server;
static atomic_int errors_printed;
static pthread_mutex_t done_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER;
static int done;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void count_done(void) {
    pthread_mutex_lock(&done_lock);
    if (++done == TOTAL) pthread_cond_signal(&done_cv);
    pthread_mutex_unlock(&done_lock);
}

static float absf(float x) { return x < 0 ? -x : x; }

static void report(int i, const char *what) {
    if (atomic_fetch_add(&errors_printed, 1) < 10) fprintf(stderr, "request %d: %s\n", i, what);
}

/* Copies the single element of output `name` into `out` (4 bytes). */
static int read_scalar(const infer_response *r, const char *name, infer_datatype want, void *out) {
    infer_datatype dt = 0;
    const int64_t *shape = NULL;
    size_t ndim = 0, bytes = 0;
    const void *data = NULL;
    if (infer_response_output_by_name(r, name, &dt, &shape, &ndim, &data, &bytes) != INFER_STATUS_OK ||
        dt != want || ndim != 2 || shape[0] != 1 || shape[1] != 1 || bytes != 4)
        return 0;
    memcpy(out, data, 4);
    return 1;
}

/* Runs on a library thread: checks, records and frees. */
static void on_response(void *user_data, infer_response *resp, uint32_t flags) {
    struct job *j = user_data;
    int i = (int)(j - jobs);
    if (infer_response_status(resp) != INFER_STATUS_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s: %s", infer_status_string(infer_response_status(resp)),
                 infer_response_error_message(resp));
        report(i, msg);
    } else if (!read_scalar(resp, "LABEL", INFER_DATATYPE_INT32, &j->got_label) ||
               !read_scalar(resp, "SCORE", INFER_DATATYPE_FP32, &j->got_score)) {
        report(i, "LABEL or SCORE missing or of the wrong type or shape");
    } else if (j->got_label != j->want_label ||
               absf(j->got_score - j->want_score) > 1e-5f * (1.0f + absf(j->want_score))) {
        char msg[128];
        snprintf(msg, sizeof msg, "got label %d score %g, expected label %d score %g", j->got_label,
                 (double)j->got_score, j->want_label, (double)j->want_score);
        report(i, msg);
    } else {
        j->correct = 1;
    }
    infer_response_free(resp);
    if (!(flags & INFER_RESPONSE_FLAG_FINAL)) return;
    atomic_fetch_add(&j->finals, 1);
    count_done();
}

struct client {
    int first;
    int refused;
};

static void *client_thread(void *arg) {
    struct client *c = arg;
    const int64_t shape[2] = {1, PIXELS};
    for (int i = c->first; i < c->first + PER_CLIENT; i++) {
        infer_request *req = NULL;
        infer_status st = infer_request_new(server, "classify", -1, &req);
        if (st == INFER_STATUS_OK) {
            st = infer_request_add_input(req, "IMAGE", INFER_DATATYPE_UINT8, shape, 2, jobs[i].image,
                                         PIXELS);
            if (st == INFER_STATUS_OK) /* takes the request, also when it fails */
                st = infer_server_enqueue(server, req, on_response, &jobs[i], NULL);
            else
                infer_request_free(req);
        }
        if (st != INFER_STATUS_OK) { /* no callback will come for this one */
            report(i, infer_last_error_message());
            c->refused++;
            count_done();
        }
    }
    return NULL;
}

/* The integer after the first "key": in json; -1 if absent. */
static long json_long(const char *json, const char *key) {
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(json, pat);
    return p ? strtol(p + strlen(pat), NULL, 10) : -1;
}

/* Prints the "batch_sizes" array of one model's statistics as a histogram. */
static void print_batch_histogram(const char *json) {
    static const char BAR[] = "########################################";
    const char *start = strstr(json, "\"batch_sizes\":[");
    if (!start) return;
    start += strlen("\"batch_sizes\":[");
    long size, count, max = 1;
    for (const char *p = start; sscanf(p, "{\"size\":%ld,\"count\":%ld}", &size, &count) == 2;) {
        if (count > max) max = count;
        p = strchr(p, '}') + 1;
        if (*p == ',') p++;
    }
    for (const char *p = start; sscanf(p, "{\"size\":%ld,\"count\":%ld}", &size, &count) == 2;) {
        int len = (int)((count * 40 + max - 1) / max);
        printf("  %3ld | %-40.*s %ld\n", size, len, BAR, count);
        p = strchr(p, '}') + 1;
        if (*p == ',') p++;
    }
}

static int register_backend(infer_server_options *o, const char *name,
                            uint32_t (*init)(void *, const char *, const char *, uint32_t, int32_t, void **),
                            uint32_t (*execute)(void *, infer_batch *), void *user_data) {
    infer_backend be;
    memset(&be, 0, sizeof be);
    be.struct_size = sizeof be;
    be.instance_init = init;
    be.execute = execute;
    return infer_server_options_register_backend(o, name, &be, user_data) == INFER_STATUS_OK;
}

int main(void) {
    /* The parameters, the images and what each request must answer. */
    for (int c = 0; c < CLASSES; c++) {
        for (int i = 0; i < PIXELS; i++) params.w[c][i] = (float)(next_random() % 2001) / 1000.0f - 1.0f;
        params.b[c] = (float)(next_random() % 201) / 100.0f - 1.0f;
    }
    int label_counts[CLASSES] = {0};
    for (int j = 0; j < TOTAL; j++) {
        float x[PIXELS], scores[CLASSES];
        for (int i = 0; i < PIXELS; i++) {
            jobs[j].image[i] = (uint8_t)(next_random() >> 24);
            x[i] = normalise(jobs[j].image[i]);
        }
        linear_row(&params, x, scores);
        jobs[j].want_label = argmax_row(scores, &jobs[j].want_score);
        label_counts[jobs[j].want_label]++;
        atomic_init(&jobs[j].finals, 0);
    }

    infer_server_options *opts = NULL;
    if (infer_server_options_new(&opts) != INFER_STATUS_OK ||
        infer_server_options_set_gpu(opts, INFER_GPU_OFF) != INFER_STATUS_OK ||
        !register_backend(opts, "c_preprocess", pre_init, pre_execute, NULL) ||
        !register_backend(opts, "c_linear", linear_init, linear_execute, &params) ||
        !register_backend(opts, "c_argmax", NULL, argmax_execute, NULL) ||
        infer_server_new(opts, &server) != INFER_STATUS_OK) {
        fprintf(stderr, "setup failed: %s\n", infer_last_error_message());
        return 1;
    }
    infer_server_options_free(opts);
    /* Composing models first: the ensemble is checked against them when it loads. */
    const char *names[4] = {"preprocess", "model", "postprocess", "classify"};
    const char *configs[4] = {PREPROCESS, MODEL, POSTPROCESS, CLASSIFY};
    for (int m = 0; m < 4; m++) {
        if (infer_server_load_model(server, names[m], configs[m], NULL) != INFER_STATUS_OK) {
            fprintf(stderr, "loading '%s' failed: %s\n", names[m], infer_last_error_message());
            infer_server_free(server);
            return 1;
        }
    }

    double t0 = now_s();
    pthread_t threads[CLIENTS];
    struct client clients[CLIENTS];
    for (int t = 0; t < CLIENTS; t++) {
        clients[t] = (struct client){t * PER_CLIENT, 0};
        pthread_create(&threads[t], NULL, client_thread, &clients[t]);
    }
    for (int t = 0; t < CLIENTS; t++) pthread_join(threads[t], NULL);
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 60;
    pthread_mutex_lock(&done_lock);
    while (done < TOTAL)
        if (pthread_cond_timedwait(&done_cv, &done_lock, &deadline) != 0) break;
    pthread_mutex_unlock(&done_lock);
    double elapsed = now_s() - t0;

    int correct = 0, missing = 0, refused = 0;
    for (int t = 0; t < CLIENTS; t++) refused += clients[t].refused;
    for (int j = 0; j < TOTAL; j++) {
        if (atomic_load(&jobs[j].finals) != 1) missing++;
        else if (jobs[j].correct) correct++;
    }
    missing -= refused;
    int wrong = TOTAL - correct - missing - refused;

    for (int j = 0; j < TOTAL; j += TOTAL / 4)
        printf("request %4d: label %d score %.3f (expected %d %.3f)\n", j, jobs[j].got_label,
               (double)jobs[j].got_score, jobs[j].want_label, (double)jobs[j].want_score);
    printf("expected labels:");
    for (int c = 0; c < CLASSES; c++) printf(" %d:%d", c, label_counts[c]);
    printf("\n%d requests from %d threads through a 3-step ensemble in %.3f s: %.0f requests/s\n",
           TOTAL, CLIENTS, elapsed, TOTAL / elapsed);
    printf("preprocess workers:");
    for (int w = 0; w < PRE_WORKERS; w++)
        printf(" #%d %u executions, %u rows;", w, atomic_load(&pre_workers[w].executions),
               atomic_load(&pre_workers[w].rows));
    printf("\n");

    char *json = NULL;
    if (infer_server_statistics_json(server, "model", &json) == INFER_STATUS_OK) {
        long inferences = json_long(json, "inference_count");
        long executions = json_long(json, "execution_count");
        printf("model: %ld inferences in %ld executions (mean batch %.2f); batch sizes:\n",
               inferences, executions, executions > 0 ? (double)inferences / (double)executions : 0.0);
        print_batch_histogram(json);
        infer_string_free(json);
    } else {
        fprintf(stderr, "statistics failed: %s\n", infer_last_error_message());
        wrong++;
    }
    infer_server_free(server);

    printf("%d correct, %d wrong or failed, %d missing, %d not sent\n", correct, wrong, missing,
           refused);
    return wrong == 0 && missing == 0 && refused == 0 ? 0 : 1;
}
