package infer

/*
#include "infer.h"
*/
import "C"

import (
	"context"
	"errors"
)

// Code is a status code of the C API (infer_status). The values are fixed by the C API.
type Code uint32

// The status codes, as in include/infer.h.
const (
	OK                Code = C.INFER_STATUS_OK
	InvalidArgument   Code = C.INFER_STATUS_INVALID_ARGUMENT
	NotFound          Code = C.INFER_STATUS_NOT_FOUND
	AlreadyExists     Code = C.INFER_STATUS_ALREADY_EXISTS
	Unavailable       Code = C.INFER_STATUS_UNAVAILABLE // shutting down, model not ready, closed
	Unsupported       Code = C.INFER_STATUS_UNSUPPORTED
	Internal          Code = C.INFER_STATUS_INTERNAL
	Cancelled         Code = C.INFER_STATUS_CANCELLED
	DeadlineExceeded  Code = C.INFER_STATUS_DEADLINE_EXCEEDED  // request or sequence timeout
	ResourceExhausted Code = C.INFER_STATUS_RESOURCE_EXHAUSTED // queue full, out of memory
)

// String returns the code's name, e.g. "INVALID_ARGUMENT" ("UNKNOWN" for other values).
func (c Code) String() string {
	return C.GoString(C.infer_status_string(C.infer_status(c)))
}

// Error is the error type of this package: a status code and the library's message,
// which names the model, tensor and value at fault where there is one.
//
// errors.Is(err, infer.ErrNotFound) matches any *Error with that code; errors.As
// gives the *Error itself. An error caused by a context (Server.Infer and the streams)
// also matches context.Canceled or context.DeadlineExceeded.
type Error struct {
	code  Code
	msg   string
	cause error
}

func newError(code Code, msg string) *Error {
	return &Error{code: code, msg: msg}
}

// Code returns the status code.
func (e *Error) Code() Code { return e.code }

// Message returns the message without the code's name.
func (e *Error) Message() string { return e.msg }

func (e *Error) Error() string {
	if e.msg == "" {
		return e.code.String()
	}
	return e.code.String() + ": " + e.msg
}

// Unwrap returns the context error behind a cancellation, nil otherwise.
func (e *Error) Unwrap() error { return e.cause }

// Is reports whether target is the sentinel of e's code (an *Error with only a code),
// so that errors.Is(err, infer.ErrInvalidArgument) works.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	if !ok {
		return false
	}
	return t == e || (t.msg == "" && t.cause == nil && t.code == e.code)
}

// Sentinels for errors.Is, one per code.
var (
	ErrInvalidArgument   = &Error{code: InvalidArgument}
	ErrNotFound          = &Error{code: NotFound}
	ErrAlreadyExists     = &Error{code: AlreadyExists}
	ErrUnavailable       = &Error{code: Unavailable}
	ErrUnsupported       = &Error{code: Unsupported}
	ErrInternal          = &Error{code: Internal}
	ErrCancelled         = &Error{code: Cancelled}
	ErrDeadlineExceeded  = &Error{code: DeadlineExceeded}
	ErrResourceExhausted = &Error{code: ResourceExhausted}
)

// CodeOf returns the status code of err: OK for nil, the code of an *Error in its
// chain, Cancelled or DeadlineExceeded for the context errors, Internal otherwise.
func CodeOf(err error) Code {
	if err == nil {
		return OK
	}
	var e *Error
	switch {
	case errors.As(err, &e):
		return e.code
	case errors.Is(err, context.DeadlineExceeded):
		return DeadlineExceeded
	case errors.Is(err, context.Canceled):
		return Cancelled
	}
	return Internal
}

// contextError is the error of a request whose context ended before its result came.
func contextError(ctx context.Context) error {
	cause := ctx.Err()
	code := Cancelled
	if errors.Is(cause, context.DeadlineExceeded) {
		code = DeadlineExceeded
	}
	return &Error{code: code, msg: "request ended by its context: " + cause.Error(), cause: cause}
}

var (
	errServerClosed   = newError(Unavailable, "the server is closed")
	errRequestUsed    = newError(InvalidArgument, "the request is closed or was already sent")
	errResponseClosed = newError(InvalidArgument, "the response is closed")
)
