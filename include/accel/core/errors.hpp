// accel/core/errors.hpp: the error family: accel::Error and its kinds.
//
// Everything accel.hpp throws is an accel::Error, so `catch (const
// accel::Error& e)` catches anything accel; each kind also derives from the
// std exception it names, so `catch (const std::invalid_argument&)` keeps
// working:
//   InvalidArgument (std::invalid_argument)  a bad value: argument,
//                       configuration, environment variable
//   OutOfRange (std::out_of_range)           a value that does not fit its type
//   LogicError (std::logic_error)            a call out of order (e.g. a second
//                       configuration for a live singleton)
//   RuntimeError (std::runtime_error)        the system or the build cannot do
//                       it (no free port, no such device or backend, bad bytes)
//   DistributedError (a RuntimeError)        a collective, the rendezvous or a
//                       process group failed (peer gone, timeout, mismatched
//                       calls); the message names the operation and the group
// Exceptions from user code (bodies, datasets) pass through unchanged.
#pragma once

#include "accel/core/config.hpp"

ACCEL_NAMESPACE_BEGIN

class Error {
 public:
  virtual ~Error() = default;
  virtual const char* what() const noexcept = 0;
};

namespace detail {
template <class Std>
class ErrorOf : public Std, public Error {
 public:
  explicit ErrorOf(const std::string& message) : Std(message) {}
  const char* what() const noexcept override { return Std::what(); }
};
}  // namespace detail

class InvalidArgument : public detail::ErrorOf<std::invalid_argument> {
 public:
  using ErrorOf::ErrorOf;
};
class OutOfRange : public detail::ErrorOf<std::out_of_range> {
 public:
  using ErrorOf::ErrorOf;
};
class LogicError : public detail::ErrorOf<std::logic_error> {
 public:
  using ErrorOf::ErrorOf;
};
class RuntimeError : public detail::ErrorOf<std::runtime_error> {
 public:
  using ErrorOf::ErrorOf;
};
class DistributedError : public RuntimeError {
 public:
  using RuntimeError::RuntimeError;
};

namespace detail {
// An exception's text without the C++ backtrace LibTorch appends to a
// c10::Error's what() ("\nException raised from ... (most recent call
// first):\nframe #0: ..."): the message is what a user acts on, and thirty
// frames from every rank bury it. The core cannot name c10::Error (no
// LibTorch here), so it cuts the text where that backtrace starts.
inline std::string without_backtrace(const std::exception& e) {
  const std::string_view text = e.what();
  return std::string(text.substr(0, text.find("\nException raised from ")));
}
}  // namespace detail

ACCEL_NAMESPACE_END
