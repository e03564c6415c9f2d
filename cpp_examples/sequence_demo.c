/*
 * Sequence batching with the C API: 12 streams (think: sensors, each with its own
 * running filter) send 20 readings each to the built-in accumulator model, whose
 * running sum per stream lives in the library as implicit state. The model has 2
 * instances x 4 slots, so 8 streams run at once and the other 4 wait in the backlog
 * until a stream ends. Each stream sends its next reading from the response callback of
 * the previous one. Every response is checked against the expected running sum; the
 * program prints a few results and the executed batch sizes, and exits non-zero on any
 * wrong or missing result.
 */
#define _GNU_SOURCE 1

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "infer.h"

#define STREAMS 12
#define READINGS 20

static const char *CONFIG =
    "name: \"running_sum\"\n"
    "backend: \"accumulator\"\n"
    "max_batch_size: 4\n"
    "input [ { name: \"INPUT\" data_type: TYPE_INT64 dims: [ 1 ] } ]\n"
    "output [ { name: \"OUTPUT\" data_type: TYPE_INT64 dims: [ 1 ] } ]\n"
    "instance_group [ { count: 2 kind: KIND_CPU } ]\n"
    "parameters { key: \"execute_delay_us\" value { string_value: \"300\" } }\n"
    "sequence_batching {\n"
    "  max_sequence_idle_microseconds: 5000000\n"
    "  direct { }\n"
    "  state [ { input_name: \"SUM_IN\" output_name: \"SUM_OUT\"\n"
    "            data_type: TYPE_INT64 dims: [ 1 ] } ]\n"
    "}\n";

struct stream {
    uint64_t id;        /* correlation ID */
    int sent;           /* readings sent so far */
    int64_t expected;   /* running sum of what was sent */
    int errors;
};

static infer_server *server;
static struct stream streams[STREAMS];
static atomic_int failures;
static pthread_mutex_t done_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER;
static int streams_done;

static int64_t reading(const struct stream *s, int i) { return (int64_t)(s->id * 100 + i); }

static void on_response(void *user_data, infer_response *resp, uint32_t flags);

/* Sends reading number s->sent of stream s. */
static int send_next(struct stream *s) {
    infer_request *r = NULL;
    int i = s->sent;
    int64_t value = reading(s, i);
    int64_t shape[2] = {1, 1};
    uint32_t f = 0;
    if (i == 0) f |= INFER_REQUEST_FLAG_SEQUENCE_START;
    if (i == READINGS - 1) f |= INFER_REQUEST_FLAG_SEQUENCE_END;
    if (infer_request_new(server, "running_sum", -1, &r) != INFER_STATUS_OK ||
        infer_request_set_correlation_id(r, s->id) != INFER_STATUS_OK ||
        infer_request_set_flags(r, f) != INFER_STATUS_OK ||
        infer_request_add_input(r, "INPUT", INFER_DATATYPE_INT64, shape, 2, &value,
                                sizeof value) != INFER_STATUS_OK) {
        fprintf(stderr, "stream %llu: building request %d failed: %s\n",
                (unsigned long long)s->id, i, infer_last_error_message());
        infer_request_free(r);
        return -1;
    }
    s->expected += value;
    s->sent++;
    /* On success the library owns the request. */
    if (infer_server_enqueue(server, r, on_response, s, NULL) != INFER_STATUS_OK) {
        fprintf(stderr, "stream %llu: enqueue failed: %s\n", (unsigned long long)s->id,
                infer_last_error_message());
        infer_request_free(r);
        return -1;
    }
    return 0;
}

static void stream_finished(void) {
    pthread_mutex_lock(&done_lock);
    streams_done++;
    pthread_cond_signal(&done_cv);
    pthread_mutex_unlock(&done_lock);
}

static void on_response(void *user_data, infer_response *resp, uint32_t flags) {
    struct stream *s = user_data;
    const void *data = NULL;
    int ok = infer_response_status(resp) == INFER_STATUS_OK &&
             infer_response_output_by_name(resp, "OUTPUT", NULL, NULL, NULL, &data, NULL) ==
                 INFER_STATUS_OK;
    int64_t got = ok ? *(const int64_t *)data : 0;
    if (!ok || got != s->expected) {
        fprintf(stderr, "stream %llu reading %d: %s (got %lld, expected %lld)\n",
                (unsigned long long)s->id, s->sent - 1,
                ok ? "wrong sum" : infer_response_error_message(resp), (long long)got,
                (long long)s->expected);
        s->errors++;
        atomic_fetch_add(&failures, 1);
    } else if (s->id <= 2 && (s->sent <= 3 || s->sent == READINGS)) {
        printf("stream %llu reading %2d: running sum %lld\n", (unsigned long long)s->id,
               s->sent - 1, (long long)got);
    }
    infer_response_free(resp);
    if (!(flags & INFER_RESPONSE_FLAG_FINAL)) return;
    /* The next reading goes from here: a callback may enqueue. */
    if (s->sent < READINGS && s->errors == 0) {
        if (send_next(s) != 0) {
            atomic_fetch_add(&failures, 1);
            stream_finished();
        }
        return;
    }
    stream_finished();
}

int main(void) {
    if (infer_server_new(NULL, &server) != INFER_STATUS_OK ||
        infer_server_load_model(server, "running_sum", CONFIG, NULL) != INFER_STATUS_OK) {
        fprintf(stderr, "start-up failed: %s\n", infer_last_error_message());
        return 1;
    }
    int started = 0;
    for (int i = 0; i < STREAMS; i++) {
        streams[i].id = (uint64_t)i + 1;
        if (send_next(&streams[i]) != 0) {
            atomic_fetch_add(&failures, 1);
            continue;
        }
        started++;
    }
    pthread_mutex_lock(&done_lock);
    while (streams_done < started) pthread_cond_wait(&done_cv, &done_lock);
    pthread_mutex_unlock(&done_lock);

    char *json = NULL;
    if (infer_server_statistics_json(server, "running_sum", &json) == INFER_STATUS_OK) {
        printf("statistics: %s\n", json);
        infer_string_free(json);
    }
    infer_server_free(server);
    int bad = atomic_load(&failures);
    printf("%d streams x %d readings: %s\n", STREAMS, READINGS,
           bad == 0 ? "all running sums correct" : "FAILED");
    return bad == 0 ? 0 : 1;
}
