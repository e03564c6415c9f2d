/*
 * A minimal test harness for the C API tests.
 *
 * CHECK(cond, ...) records one check; on failure it prints the file, line, the condition
 * and an optional printf-style note. CHECK_OK(expr) checks that a call returns
 * INFER_STATUS_OK and prints the library's last error message otherwise. CHECK_STATUS
 * checks for a given status and that the last error message is not empty.
 *
 * The test program prints "N passed, N failed" alone on its last line and exits
 * non-zero when any check failed.
 */
#ifndef INFER_TEST_HARNESS_H
#define INFER_TEST_HARNESS_H

#define _GNU_SOURCE 1

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "infer.h"

extern atomic_int harness_passed;
extern atomic_int harness_failed;

#define CHECK(cond, ...)                                                       \
    do {                                                                       \
        if (cond) {                                                            \
            atomic_fetch_add(&harness_passed, 1);                              \
        } else {                                                               \
            atomic_fetch_add(&harness_failed, 1);                              \
            fprintf(stderr, "FAIL %s:%d: %s", __FILE__, __LINE__, #cond);      \
            harness_note(" " __VA_ARGS__);                                      \
        }                                                                      \
    } while (0)

#define CHECK_OK(expr)                                                         \
    do {                                                                       \
        infer_status st_ = (expr);                                             \
        CHECK(st_ == INFER_STATUS_OK, "%s: %s", infer_status_string(st_),      \
              infer_last_error_message());                                     \
    } while (0)

/* The call returns `want` and leaves a non-empty message. */
#define CHECK_STATUS(expr, want)                                               \
    do {                                                                       \
        infer_status st_ = (expr);                                             \
        const char *msg_ = infer_last_error_message();                         \
        CHECK(st_ == (want), "%s (expected %s): %s", infer_status_string(st_), \
              infer_status_string(want), msg_);                                \
        CHECK(msg_ != NULL && msg_[0] != '\0', "no error message for %s",      \
              #expr);                                                          \
    } while (0)

/* Prints the optional note of a failed CHECK and ends the line. */
void harness_note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Runs one test group, printing its name. */
#define RUN(group)                                                             \
    do {                                                                       \
        printf("== %s\n", #group);                                             \
        fflush(stdout);                                                        \
        group();                                                               \
    } while (0)

/* Monotonic clock in seconds. */
double harness_now(void);

/* Sleeps for `ms` milliseconds. */
void harness_sleep_ms(long ms);

/* Waits up to `timeout_s` for *counter >= want; returns whether it got there. */
int harness_wait_at_least(atomic_int *counter, int want, double timeout_s);

/* Shared helpers (test_api.c). */
extern const char *ADD_SUB_PBTXT;
infer_server *new_server(void);
infer_request *add_sub_request(infer_server *s, const char *model, const float a[4],
                               const float b[4]);
int expect_add_sub(const infer_response *r, const float a[4], const float b[4]);

/* Test groups in test_scheduling.c. */
void test_custom_backend(void);
void test_custom_backend_on_options(void);
void test_decoupled_backend(void);
void test_pause_and_batch_sizes(void);
void test_queue_full(void);
void test_cancel_queued(void);
void test_shutdown_with_queued_requests(void);
void test_borrowed_inputs(void);

/* Test groups in test_sequence.c. */
void test_sequence_single(void);
void test_sequence_string_ids(void);
void test_sequence_errors(void);
void test_sequence_controls(void);

#endif /* INFER_TEST_HARNESS_H */
