package infer

/*
#include <stdlib.h>
#include "infer.h"
*/
import "C"

import (
	"encoding/binary"
	"fmt"
	"unsafe"
)

// DataType is a tensor element type (infer_datatype).
type DataType uint32

// The element types, as in include/infer.h.
const (
	TypeInvalid DataType = C.INFER_DATATYPE_INVALID
	TypeBool    DataType = C.INFER_DATATYPE_BOOL
	TypeUint8   DataType = C.INFER_DATATYPE_UINT8
	TypeUint16  DataType = C.INFER_DATATYPE_UINT16
	TypeUint32  DataType = C.INFER_DATATYPE_UINT32
	TypeUint64  DataType = C.INFER_DATATYPE_UINT64
	TypeInt8    DataType = C.INFER_DATATYPE_INT8
	TypeInt16   DataType = C.INFER_DATATYPE_INT16
	TypeInt32   DataType = C.INFER_DATATYPE_INT32
	TypeInt64   DataType = C.INFER_DATATYPE_INT64
	TypeFP16    DataType = C.INFER_DATATYPE_FP16
	TypeFP32    DataType = C.INFER_DATATYPE_FP32
	TypeFP64    DataType = C.INFER_DATATYPE_FP64
	TypeBytes   DataType = C.INFER_DATATYPE_BYTES // elements: little-endian uint32 length, then the bytes
	TypeBF16    DataType = C.INFER_DATATYPE_BF16
)

// String returns the type's name, e.g. "FP32" ("INVALID" for unknown values).
func (dt DataType) String() string {
	return C.GoString(C.infer_datatype_string(C.infer_datatype(dt)))
}

// ByteSize returns the size of one element in bytes; 0 for BYTES and unknown types.
func (dt DataType) ByteSize() int {
	return int(C.infer_datatype_byte_size(C.infer_datatype(dt)))
}

// ParseDataType parses "FP32" or "TYPE_FP32" ("STRING" gives TypeBytes); TypeInvalid
// for unknown names.
func ParseDataType(name string) DataType {
	cs, err := cString("datatype", name)
	if err != nil {
		return TypeInvalid
	}
	defer freeCString(cs)
	return DataType(C.infer_datatype_from_string(cs))
}

// Element is a Go type with a fixed-size tensor element type: bool (one byte, BOOL),
// the sized integers and the floats. FP16, BF16 and BYTES tensors go through the raw
// []byte calls instead.
type Element interface {
	bool | uint8 | uint16 | uint32 | uint64 | int8 | int16 | int32 | int64 | float32 | float64
}

// DataTypeOf returns the tensor element type of T.
func DataTypeOf[T Element]() DataType {
	var zero T
	switch any(zero).(type) {
	case bool:
		return TypeBool
	case uint8:
		return TypeUint8
	case uint16:
		return TypeUint16
	case uint32:
		return TypeUint32
	case uint64:
		return TypeUint64
	case int8:
		return TypeInt8
	case int16:
		return TypeInt16
	case int32:
		return TypeInt32
	case int64:
		return TypeInt64
	case float32:
		return TypeFP32
	case float64:
		return TypeFP64
	}
	return TypeInvalid
}

// asBytes views the elements of s as bytes (host byte order, which the library shares).
func asBytes[T Element](s []T) []byte {
	if len(s) == 0 {
		return nil
	}
	var zero T
	return unsafe.Slice((*byte)(unsafe.Pointer(&s[0])), len(s)*int(unsafe.Sizeof(zero)))
}

// elementsFrom copies raw tensor bytes into a new []T; the byte count must be a whole
// number of elements.
func elementsFrom[T Element](raw []byte) ([]T, error) {
	var zero T
	size := int(unsafe.Sizeof(zero))
	if len(raw)%size != 0 {
		return nil, newError(InvalidArgument, fmt.Sprintf(
			"%d bytes are not a whole number of %d-byte elements", len(raw), size))
	}
	out := make([]T, len(raw)/size)
	copy(asBytes(out), raw)
	return out, nil
}

// EncodeBytes packs elements into the layout of a BYTES tensor: each element as a
// little-endian uint32 length followed by its bytes.
func EncodeBytes(elements [][]byte) []byte {
	n := 0
	for _, e := range elements {
		n += 4 + len(e)
	}
	out := make([]byte, 0, n)
	for _, e := range elements {
		out = binary.LittleEndian.AppendUint32(out, uint32(len(e)))
		out = append(out, e...)
	}
	return out
}

// DecodeBytes splits the data of a BYTES tensor into its elements (copies).
func DecodeBytes(raw []byte) ([][]byte, error) {
	var out [][]byte
	for len(raw) > 0 {
		if len(raw) < 4 {
			return nil, newError(InvalidArgument, "BYTES tensor: truncated element length")
		}
		n := binary.LittleEndian.Uint32(raw)
		raw = raw[4:]
		if uint64(n) > uint64(len(raw)) {
			return nil, newError(InvalidArgument, fmt.Sprintf(
				"BYTES tensor: element of %d bytes with only %d left", n, len(raw)))
		}
		out = append(out, append([]byte(nil), raw[:n]...))
		raw = raw[n:]
	}
	return out, nil
}
