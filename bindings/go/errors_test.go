package infer

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"
)

func TestCodeNamesComeFromTheLibrary(t *testing.T) {
	for code, name := range map[Code]string{
		OK: "OK", InvalidArgument: "INVALID_ARGUMENT", NotFound: "NOT_FOUND",
		AlreadyExists: "ALREADY_EXISTS", Unavailable: "UNAVAILABLE", Unsupported: "UNSUPPORTED",
		Internal: "INTERNAL", Cancelled: "CANCELLED", DeadlineExceeded: "DEADLINE_EXCEEDED",
		ResourceExhausted: "RESOURCE_EXHAUSTED", Code(1000): "UNKNOWN",
	} {
		if got := code.String(); got != name {
			t.Errorf("Code(%d).String() = %q, want %q", uint32(code), got, name)
		}
	}
}

func TestErrorMatchesItsSentinelAndWrappers(t *testing.T) {
	err := newError(NotFound, "model 'nope' is not loaded")
	if err.Error() != "NOT_FOUND: model 'nope' is not loaded" {
		t.Errorf("Error() = %q", err.Error())
	}
	wrapped := fmt.Errorf("loading: %w", err)
	if !errors.Is(wrapped, ErrNotFound) {
		t.Error("errors.Is(wrapped, ErrNotFound) = false")
	}
	if errors.Is(wrapped, ErrInvalidArgument) {
		t.Error("errors.Is(wrapped, ErrInvalidArgument) = true")
	}
	if errors.Is(wrapped, newError(NotFound, "another message")) {
		t.Error("an *Error with a message matched as a sentinel")
	}
	var e *Error
	if !errors.As(wrapped, &e) || e.Code() != NotFound || e.Message() != "model 'nope' is not loaded" {
		t.Errorf("errors.As gave %#v", e)
	}
	if CodeOf(wrapped) != NotFound || CodeOf(nil) != OK || CodeOf(errors.New("x")) != Internal {
		t.Error("CodeOf is wrong")
	}
	if ErrCancelled.Error() != "CANCELLED" {
		t.Errorf("sentinel Error() = %q", ErrCancelled.Error())
	}
}

func TestContextErrorsKeepTheirCause(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := contextError(ctx)
	if !errors.Is(err, context.Canceled) || !errors.Is(err, ErrCancelled) || CodeOf(err) != Cancelled {
		t.Errorf("cancelled: %v", err)
	}
	ctx, cancel = context.WithTimeout(context.Background(), time.Nanosecond)
	defer cancel()
	<-ctx.Done()
	err = contextError(ctx)
	if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, ErrDeadlineExceeded) {
		t.Errorf("deadline: %v", err)
	}
}

func TestAPIVersionRule(t *testing.T) {
	major, minor := APIVersion()
	if major != APIVersionMajor || minor < APIVersionMinor {
		t.Fatalf("library C API %d.%d, header %d.%d", major, minor, APIVersionMajor, APIVersionMinor)
	}
	if Version() == "" {
		t.Error("Version() is empty")
	}
	for _, c := range []struct {
		libMajor, libMinor, major, minor uint32
		ok                               bool
	}{
		{0, 1, 0, 1, true},
		{0, 2, 0, 1, true},
		{0, 0, 0, 1, false},
		{1, 1, 0, 1, false},
		{0, 9, 1, 0, false},
	} {
		err := checkAPIVersion(c.libMajor, c.libMinor, c.major, c.minor)
		if (err == nil) != c.ok {
			t.Errorf("library %d.%d, binding %d.%d: err = %v", c.libMajor, c.libMinor, c.major, c.minor, err)
		}
		if err != nil && CodeOf(err) != Unavailable {
			t.Errorf("version error has code %v", CodeOf(err))
		}
	}
}

func TestDataTypes(t *testing.T) {
	if TypeFP32.String() != "FP32" || TypeFP32.ByteSize() != 4 || TypeBytes.ByteSize() != 0 {
		t.Error("FP32/BYTES properties")
	}
	if ParseDataType("TYPE_INT64") != TypeInt64 || ParseDataType("STRING") != TypeBytes ||
		ParseDataType("nonsense") != TypeInvalid || ParseDataType("FP\x0032") != TypeInvalid {
		t.Error("ParseDataType")
	}
	if DataTypeOf[bool]() != TypeBool || DataTypeOf[uint16]() != TypeUint16 || DataTypeOf[float64]() != TypeFP64 {
		t.Error("DataTypeOf")
	}
}

func TestBytesEncoding(t *testing.T) {
	in := [][]byte{[]byte("hello"), {}, []byte("wörld")}
	raw := EncodeBytes(in)
	if len(raw) != 4+5+4+4+6 || raw[0] != 5 || raw[1] != 0 {
		t.Fatalf("EncodeBytes = %v", raw)
	}
	out, err := DecodeBytes(raw)
	if err != nil || len(out) != 3 || string(out[0]) != "hello" || len(out[1]) != 0 || string(out[2]) != "wörld" {
		t.Fatalf("DecodeBytes = %q, %v", out, err)
	}
	if _, err := DecodeBytes(raw[:len(raw)-1]); CodeOf(err) != InvalidArgument {
		t.Errorf("truncated element: %v", err)
	}
	if _, err := DecodeBytes([]byte{1, 0}); CodeOf(err) != InvalidArgument {
		t.Errorf("truncated length: %v", err)
	}
}
