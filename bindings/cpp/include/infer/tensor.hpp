// libinfer C++ binding: datatypes, memory types and views of tensors the library owns.
//
// A Tensor or TensorView never owns memory: it points into a Response (valid until the
// Response is destroyed) or into a Batch (valid until the backend's execute returns).
// A Response hands out a Tensor only for outputs in host memory; outputs in GPU memory
// come as a DeviceTensor, which has a device address and no host accessors.
// Typed views check the element type against the tensor's datatype and throw on a
// mismatch; they never reinterpret bytes of another type.
#ifndef INFER_CPP_TENSOR_HPP
#define INFER_CPP_TENSOR_HPP

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "infer.h"
#include "infer/error.hpp"

namespace infer {

/// A tensor element type (the INFER_DATATYPE_* values).
enum class DataType : infer_datatype {
    Invalid = INFER_DATATYPE_INVALID,
    Bool = INFER_DATATYPE_BOOL,
    UInt8 = INFER_DATATYPE_UINT8,
    UInt16 = INFER_DATATYPE_UINT16,
    UInt32 = INFER_DATATYPE_UINT32,
    UInt64 = INFER_DATATYPE_UINT64,
    Int8 = INFER_DATATYPE_INT8,
    Int16 = INFER_DATATYPE_INT16,
    Int32 = INFER_DATATYPE_INT32,
    Int64 = INFER_DATATYPE_INT64,
    FP16 = INFER_DATATYPE_FP16,
    FP32 = INFER_DATATYPE_FP32,
    FP64 = INFER_DATATYPE_FP64,
    Bytes = INFER_DATATYPE_BYTES,
    BF16 = INFER_DATATYPE_BF16,
};

/// "FP32", "INT64", ...; "INVALID" for unknown values.
inline const char *to_string(DataType dt) noexcept {
    return infer_datatype_string(static_cast<infer_datatype>(dt));
}

/// Parses "FP32" or "TYPE_FP32"; DataType::Invalid for unknown names.
inline DataType datatype_from_string(const std::string &name) noexcept {
    return static_cast<DataType>(infer_datatype_from_string(name.c_str()));
}

/// Bytes per element; 0 for BYTES and unknown types.
inline std::size_t byte_size(DataType dt) noexcept {
    return infer_datatype_byte_size(static_cast<infer_datatype>(dt));
}

/// Where a tensor's memory lives (the INFER_MEMORY_* values).
enum class MemoryType : infer_memory_type {
    Cpu = INFER_MEMORY_CPU,              ///< ordinary host memory
    CpuPinned = INFER_MEMORY_CPU_PINNED, ///< page-locked host memory (a GPU copies it directly)
    Gpu = INFER_MEMORY_GPU,              ///< device memory of one GPU
};

/// "CPU", "CPU_PINNED", "GPU"; "UNKNOWN" for other values.
inline const char *to_string(MemoryType mem) noexcept {
    switch (mem) {
    case MemoryType::Cpu:
        return "CPU";
    case MemoryType::CpuPinned:
        return "CPU_PINNED";
    case MemoryType::Gpu:
        return "GPU";
    }
    return "UNKNOWN";
}

/// Where a response output is: {Cpu, 0} in host memory, {Gpu, id} on GPU `id`.
struct MemoryLocation {
    MemoryType type = MemoryType::Cpu;
    int64_t device_id = 0;

    bool on_host() const noexcept { return type != MemoryType::Gpu; }
    friend bool operator==(const MemoryLocation &a, const MemoryLocation &b) noexcept {
        return a.type == b.type && a.device_id == b.device_id;
    }
    friend bool operator!=(const MemoryLocation &a, const MemoryLocation &b) noexcept {
        return !(a == b);
    }
};

/// The raw bits of an IEEE half-precision (FP16) element; C++17 has no such type.
struct fp16_t {
    uint16_t bits;
};
/// The raw bits of a bfloat16 (BF16) element.
struct bf16_t {
    uint16_t bits;
};

/// The shape of a tensor (dim 0 is the batch dimension where the model batches).
using Shape = std::vector<int64_t>;

/// Maps a C++ element type to its DataType; unmapped types do not compile.
template <class T>
struct datatype_of {
    static_assert(sizeof(T) == 0,
                  "no infer::DataType for this element type: use bool, (u)int8..64_t, float, "
                  "double, infer::fp16_t or infer::bf16_t");
};
#define INFER_CPP_DATATYPE_OF(T, DT)                                                          \
    template <>                                                                               \
    struct datatype_of<T> {                                                                   \
        static constexpr DataType value = DataType::DT;                                       \
    }
INFER_CPP_DATATYPE_OF(bool, Bool);
INFER_CPP_DATATYPE_OF(uint8_t, UInt8);
INFER_CPP_DATATYPE_OF(uint16_t, UInt16);
INFER_CPP_DATATYPE_OF(uint32_t, UInt32);
INFER_CPP_DATATYPE_OF(uint64_t, UInt64);
INFER_CPP_DATATYPE_OF(int8_t, Int8);
INFER_CPP_DATATYPE_OF(int16_t, Int16);
INFER_CPP_DATATYPE_OF(int32_t, Int32);
INFER_CPP_DATATYPE_OF(int64_t, Int64);
INFER_CPP_DATATYPE_OF(fp16_t, FP16);
INFER_CPP_DATATYPE_OF(float, FP32);
INFER_CPP_DATATYPE_OF(double, FP64);
INFER_CPP_DATATYPE_OF(bf16_t, BF16);
#undef INFER_CPP_DATATYPE_OF

template <class T>
constexpr DataType datatype_of_v = datatype_of<std::remove_cv_t<T>>::value;

static_assert(sizeof(bool) == 1, "BOOL tensors hold one byte per element");

namespace detail {

/// Elements of a shape; throws INVALID_ARGUMENT for a negative dim or an overflow.
inline std::size_t element_count(const Shape &shape) {
    std::size_t n = 1;
    for (int64_t d : shape) {
        if (d < 0) {
            throw Error(INFER_STATUS_INVALID_ARGUMENT,
                        "shape dim " + std::to_string(d) + " is negative");
        }
        const auto du = static_cast<std::size_t>(d);
        if (du != 0 && n > SIZE_MAX / du) {
            throw Error(INFER_STATUS_INVALID_ARGUMENT, "shape's element count overflows");
        }
        n *= du;
    }
    return n;
}

} // namespace detail

/// A span-like view of a tensor's elements with its shape. `T` is const-qualified for
/// tensors the caller may only read (response outputs, batch inputs). The view borrows:
/// it is valid as long as the Response or Batch it came from.
template <class T>
class TensorView {
public:
    using element_type = T;
    using value_type = std::remove_cv_t<T>;
    using size_type = std::size_t;
    using pointer = T *;
    using reference = T &;
    using iterator = T *;

    TensorView() = default;
    TensorView(T *data, std::size_t size, Shape shape, std::string name = {})
        : data_(data), size_(size), shape_(std::move(shape)), name_(std::move(name)) {}

    /// A read-only view of a writable one.
    template <class U, class = std::enable_if_t<std::is_same_v<const U, T> &&
                                                !std::is_same_v<U, T>>>
    TensorView(const TensorView<U> &other)
        : data_(other.data()), size_(other.size()), shape_(other.shape()), name_(other.name()) {}

    T *data() const noexcept { return data_; }
    /// Number of elements (the product of the shape).
    std::size_t size() const noexcept { return size_; }
    bool empty() const noexcept { return size_ == 0; }
    std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
    const Shape &shape() const noexcept { return shape_; }
    /// The tensor's name ("" where it has none).
    const std::string &name() const noexcept { return name_; }
    DataType datatype() const noexcept { return datatype_of_v<T>; }

    T *begin() const noexcept { return data_; }
    T *end() const noexcept { return data_ + size_; }
    /// Unchecked element access.
    T &operator[](std::size_t i) const noexcept { return data_[i]; }
    /// Checked element access: std::out_of_range past the end.
    T &at(std::size_t i) const {
        if (i >= size_) {
            throw std::out_of_range("infer::TensorView '" + name_ + "': index " +
                                    std::to_string(i) + " >= size " + std::to_string(size_));
        }
        return data_[i];
    }
    /// A copy of the elements.
    std::vector<value_type> to_vector() const { return std::vector<value_type>(begin(), end()); }

private:
    T *data_ = nullptr;
    std::size_t size_ = 0;
    Shape shape_;
    std::string name_;
};

/// An untyped, read-only tensor: a response output or a batch input. Borrowed like
/// TensorView.
class Tensor {
public:
    Tensor() = default;
    Tensor(std::string name, DataType dt, Shape shape, const void *data, std::size_t byte_size)
        : name_(std::move(name)), datatype_(dt), shape_(std::move(shape)), data_(data),
          byte_size_(byte_size) {}

    const std::string &name() const noexcept { return name_; }
    DataType datatype() const noexcept { return datatype_; }
    const Shape &shape() const noexcept { return shape_; }
    const void *data() const noexcept { return data_; }
    std::size_t byte_size() const noexcept { return byte_size_; }
    /// Elements of the shape (for BYTES: the number of strings).
    std::size_t element_count() const { return detail::element_count(shape_); }

    /// The elements as T; throws INVALID_ARGUMENT when T is not the tensor's datatype.
    template <class T>
    TensorView<const T> as() const {
        if (datatype_of_v<T> != datatype_) {
            throw Error(INFER_STATUS_INVALID_ARGUMENT,
                        "tensor '" + name_ + "' is " + to_string(datatype_) + ", not " +
                            to_string(datatype_of_v<T>) + " as the caller asked");
        }
        const std::size_t n = element_count();
        if (n * sizeof(T) != byte_size_) {
            throw Error(INFER_STATUS_INTERNAL, "tensor '" + name_ + "': " +
                                                   std::to_string(byte_size_) +
                                                   " bytes do not hold " + std::to_string(n) +
                                                   " elements of " + to_string(datatype_));
        }
        return TensorView<const T>(static_cast<const T *>(data_), n, shape_, name_);
    }

    /// The elements of a BYTES tensor, each a view of the tensor's memory; throws
    /// INVALID_ARGUMENT for other datatypes or a malformed buffer.
    std::vector<std::string_view> strings() const {
        if (datatype_ != DataType::Bytes) {
            throw Error(INFER_STATUS_INVALID_ARGUMENT, "tensor '" + name_ + "' is " +
                                                           to_string(datatype_) +
                                                           ", not BYTES");
        }
        std::vector<std::string_view> out;
        const auto *p = static_cast<const char *>(data_);
        std::size_t at = 0;
        while (at < byte_size_) {
            if (byte_size_ - at < 4) {
                throw Error(INFER_STATUS_INVALID_ARGUMENT,
                            "tensor '" + name_ + "': truncated BYTES length prefix");
            }
            const auto *b = reinterpret_cast<const unsigned char *>(p + at);
            const uint32_t len = static_cast<uint32_t>(b[0]) | static_cast<uint32_t>(b[1]) << 8 |
                  static_cast<uint32_t>(b[2]) << 16 | static_cast<uint32_t>(b[3]) << 24;
            at += 4;
            if (byte_size_ - at < len) {
                throw Error(INFER_STATUS_INVALID_ARGUMENT,
                            "tensor '" + name_ + "': truncated BYTES element");
            }
            out.emplace_back(p + at, len);
            at += len;
        }
        return out;
    }

private:
    std::string name_;
    DataType datatype_ = DataType::Invalid;
    Shape shape_;
    const void *data_ = nullptr;
    std::size_t byte_size_ = 0;
};

/// A response output in GPU memory: its name, datatype, shape and the device address of
/// its bytes. The address is not host memory: never dereference it on the host; read it
/// with CUDA on `device_id()` (copies, kernels). Borrowed like Tensor: valid until the
/// Response it came from is destroyed; the work that produced it is complete.
class DeviceTensor {
public:
    DeviceTensor() = default;
    DeviceTensor(std::string name, DataType dt, Shape shape, const void *device_ptr,
                 std::size_t byte_size, int64_t device_id)
        : name_(std::move(name)), datatype_(dt), shape_(std::move(shape)), ptr_(device_ptr),
          byte_size_(byte_size), device_id_(device_id) {}

    const std::string &name() const noexcept { return name_; }
    DataType datatype() const noexcept { return datatype_; }
    const Shape &shape() const noexcept { return shape_; }
    /// The device address (a CUdeviceptr as a pointer) of the first byte.
    const void *device_ptr() const noexcept { return ptr_; }
    std::size_t byte_size() const noexcept { return byte_size_; }
    /// The GPU that holds the bytes.
    int64_t device_id() const noexcept { return device_id_; }
    /// Elements of the shape.
    std::size_t element_count() const { return detail::element_count(shape_); }

private:
    std::string name_;
    DataType datatype_ = DataType::Invalid;
    Shape shape_;
    const void *ptr_ = nullptr;
    std::size_t byte_size_ = 0;
    int64_t device_id_ = 0;
};

/// Encodes strings in the BYTES layout: each a little-endian uint32 length, then its
/// bytes. Throws INVALID_ARGUMENT for a string longer than 4 GiB.
template <class Strings>
std::vector<char> encode_bytes(const Strings &strings) {
    std::size_t total = 0;
    for (const auto &s : strings) {
        total += 4 + std::string_view(s).size();
    }
    std::vector<char> out;
    out.reserve(total);
    for (const auto &s : strings) {
        const std::string_view v(s);
        if (static_cast<uint64_t>(v.size()) > UINT32_MAX) {
            throw Error(INFER_STATUS_INVALID_ARGUMENT, "a BYTES element exceeds 4 GiB");
        }
        const auto len = static_cast<uint32_t>(v.size());
        for (int shift = 0; shift < 32; shift += 8) {
            out.push_back(static_cast<char>((len >> shift) & 0xffu));
        }
        out.insert(out.end(), v.begin(), v.end());
    }
    return out;
}

} // namespace infer

#endif // INFER_CPP_TENSOR_HPP
