/*
 * Dynamic batching with the C API: 8 threads each send 500 requests to the built-in
 * add_sub model through infer_server_enqueue; the library groups them into batches.
 * Every response is checked (OUTPUT0 = a + b, OUTPUT1 = a - b); the program prints a
 * few results, the throughput, the model's statistics and its batch-size histogram, and
 * exits non-zero on any wrong or missing result.
 */
#define _GNU_SOURCE 1

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "infer.h"

#define THREADS 8
#define PER_THREAD 500
#define TOTAL (THREADS * PER_THREAD)
#define SHOWN 4

static const char *CONFIG =
    "name: \"add_sub\"\n"
    "backend: \"add_sub\"\n"
    "max_batch_size: 64\n"
    "input [\n"
    "  { name: \"INPUT0\" data_type: TYPE_FP32 dims: [ 4 ] },\n"
    "  { name: \"INPUT1\" data_type: TYPE_FP32 dims: [ 4 ] }\n"
    "]\n"
    "output [\n"
    "  { name: \"OUTPUT0\" data_type: TYPE_FP32 dims: [ 4 ] },\n"
    "  { name: \"OUTPUT1\" data_type: TYPE_FP32 dims: [ 4 ] }\n"
    "]\n"
    "dynamic_batching {\n"
    "  max_queue_delay_microseconds: 200\n"
    "  preferred_batch_size: [ 16, 32, 64 ]\n"
    "}\n"
    "parameters { key: \"execute_delay_us\" value { string_value: \"500\" } }\n";

/* One request's inputs and what its callback found. */
struct job {
    float a[4], b[4];
    float sum[4], diff[4];
    atomic_int finals;
    atomic_int status; /* -1 until answered */
    int correct;
};

static struct job jobs[TOTAL];
static pthread_mutex_t done_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER;
static int done;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int read_output(const infer_response *r, const char *name, float out[4]) {
    const int64_t *shape = NULL;
    size_t ndim = 0, bytes = 0;
    const void *data = NULL;
    infer_datatype dt = 0;
    if (infer_response_output_by_name(r, name, &dt, &shape, &ndim, &data, &bytes) != INFER_STATUS_OK)
        return 0;
    if (dt != INFER_DATATYPE_FP32 || ndim != 2 || shape[0] != 1 || shape[1] != 4 || bytes != 16)
        return 0;
    memcpy(out, data, 16);
    return 1;
}

/* Runs on a library thread; holds no library lock, so it only records and frees. */
static void on_response(void *user_data, infer_response *resp, uint32_t flags) {
    struct job *j = user_data;
    int st = (int)infer_response_status(resp);
    int ok = st == INFER_STATUS_OK && read_output(resp, "OUTPUT0", j->sum) &&
             read_output(resp, "OUTPUT1", j->diff);
    for (int k = 0; ok && k < 4; k++)
        ok = j->sum[k] == j->a[k] + j->b[k] && j->diff[k] == j->a[k] - j->b[k];
    if (st != INFER_STATUS_OK)
        fprintf(stderr, "request failed: %s\n", infer_response_error_message(resp));
    infer_response_free(resp);
    if (!(flags & INFER_RESPONSE_FLAG_FINAL)) return;
    j->correct = ok;
    atomic_store(&j->status, st);
    atomic_fetch_add(&j->finals, 1);
    pthread_mutex_lock(&done_lock);
    if (++done == TOTAL) pthread_cond_signal(&done_cv);
    pthread_mutex_unlock(&done_lock);
}

struct client {
    infer_server *server;
    int first;
    int refused;
};

static void *client_thread(void *arg) {
    struct client *c = arg;
    const int64_t shape[2] = {1, 4};
    for (int i = c->first; i < c->first + PER_THREAD; i++) {
        infer_request *req = NULL;
        infer_status st = infer_request_new(c->server, "add_sub", -1, &req);
        if (st == INFER_STATUS_OK) {
            st = infer_request_add_input(req, "INPUT0", INFER_DATATYPE_FP32, shape, 2, jobs[i].a, 16);
            if (st == INFER_STATUS_OK)
                st = infer_request_add_input(req, "INPUT1", INFER_DATATYPE_FP32, shape, 2, jobs[i].b, 16);
            if (st == INFER_STATUS_OK) /* takes the request, also when it fails */
                st = infer_server_enqueue(c->server, req, on_response, &jobs[i], NULL);
            else
                infer_request_free(req);
        }
        if (st != INFER_STATUS_OK) { /* no callback will come for this one */
            fprintf(stderr, "request %d not sent: %s\n", i, infer_last_error_message());
            c->refused++;
            pthread_mutex_lock(&done_lock);
            if (++done == TOTAL) pthread_cond_signal(&done_cv);
            pthread_mutex_unlock(&done_lock);
        }
    }
    return NULL;
}

/* Prints the "batch_sizes" array of the statistics JSON as a histogram. */
static void print_histogram(const char *json) {
    const char *p = strstr(json, "\"batch_sizes\":[");
    if (!p) return;
    p += strlen("\"batch_sizes\":[");
    long size, count, max = 1;
    const char *q = p;
    while (sscanf(q, "{\"size\":%ld,\"count\":%ld}", &size, &count) == 2) {
        if (count > max) max = count;
        q = strchr(q, '}') + 1;
        if (*q == ',') q++;
    }
    printf("batch size histogram (executions per batch size):\n");
    while (sscanf(p, "{\"size\":%ld,\"count\":%ld}", &size, &count) == 2) {
        int bar = (int)((count * 50 + max - 1) / max);
        printf("  %3ld | %-50.*s %ld\n", size, bar, "##################################################", count);
        p = strchr(p, '}') + 1;
        if (*p == ',') p++;
    }
}

int main(void) {
    infer_server_options *opts = NULL;
    infer_server *server = NULL;
    if (infer_server_options_new(&opts) || infer_server_options_set_gpu(opts, INFER_GPU_OFF) ||
        infer_server_new(opts, &server) ||
        infer_server_load_model(server, "add_sub", CONFIG, NULL)) {
        fprintf(stderr, "setup failed: %s\n", infer_last_error_message());
        return 1;
    }
    infer_server_options_free(opts);

    for (int i = 0; i < TOTAL; i++) {
        for (int k = 0; k < 4; k++) {
            jobs[i].a[k] = (float)(i + k);
            jobs[i].b[k] = (float)(3 * k - i % 7);
        }
        atomic_init(&jobs[i].finals, 0);
        atomic_init(&jobs[i].status, -1);
    }

    double t0 = now_s();
    pthread_t threads[THREADS];
    struct client clients[THREADS];
    for (int t = 0; t < THREADS; t++) {
        clients[t] = (struct client){server, t * PER_THREAD, 0};
        pthread_create(&threads[t], NULL, client_thread, &clients[t]);
    }
    for (int t = 0; t < THREADS; t++) pthread_join(threads[t], NULL);
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 60;
    pthread_mutex_lock(&done_lock);
    while (done < TOTAL)
        if (pthread_cond_timedwait(&done_cv, &done_lock, &deadline) != 0) break;
    pthread_mutex_unlock(&done_lock);
    double elapsed = now_s() - t0;

    int wrong = 0, missing = 0, refused = 0;
    for (int t = 0; t < THREADS; t++) refused += clients[t].refused;
    for (int i = 0; i < TOTAL; i++) {
        if (atomic_load(&jobs[i].finals) != 1) missing++;
        else if (!jobs[i].correct) wrong++;
    }
    missing -= refused;
    for (int i = 0; i < TOTAL; i += TOTAL / SHOWN) {
        const struct job *j = &jobs[i];
        printf("request %4d: a=[%g %g %g %g] b=[%g %g %g %g] -> a+b=[%g %g %g %g] a-b=[%g %g %g %g]\n", i,
               j->a[0], j->a[1], j->a[2], j->a[3], j->b[0], j->b[1], j->b[2], j->b[3],
               j->sum[0], j->sum[1], j->sum[2], j->sum[3], j->diff[0], j->diff[1], j->diff[2], j->diff[3]);
    }
    printf("%d requests from %d threads in %.3f s: %.0f requests/s\n", TOTAL, THREADS, elapsed,
           TOTAL / elapsed);

    char *json = NULL;
    if (infer_server_statistics_json(server, "add_sub", &json) == INFER_STATUS_OK) {
        printf("statistics: %s\n", json);
        print_histogram(json);
        infer_string_free(json);
    }
    infer_server_free(server);

    printf("%d correct, %d wrong, %d missing, %d not sent\n", TOTAL - wrong - missing - refused, wrong,
           missing, refused);
    return wrong == 0 && missing == 0 && refused == 0 ? 0 : 1;
}
