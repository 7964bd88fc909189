// accel/training/io/checked_file.hpp: files written with every error checked: CheckedFile, atomic writes, archives.
//
// Checkpoints and weights are written here, never through std::ofstream or
// LibTorch's OutputArchive::save_to(path): a stream says only that it failed,
// not why (a full disk, a quota, an I/O error), and LibTorch's archive
// writer, when a write fails, throws from its destructor, which ends the
// process with std::terminate (pytorch#156955). Here the first error is kept
// with its errno, nothing is thrown while LibTorch's writer runs, and the
// caller gets an accel::RuntimeError naming the file and the cause; a file
// that could not be written whole is removed.
#pragma once

#include "accel/core/errors.hpp"
#include "accel/training/io/file_digest.hpp"
#include "accel/training/torch_nn.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
[[noreturn]] inline void throw_errno(const std::string& what, const std::filesystem::path& path, int error = errno) {
  throw RuntimeError("accel: " + what + " " + path.string() + ": " + std::strerror(error));
}

// open + fsync + close: a file's bytes, or a directory's entries, on disk.
inline void fsync_path(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw_errno("cannot open", path);
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (rc != 0) throw_errno("cannot fsync", path, error);
}

inline std::filesystem::path sibling(const std::filesystem::path& dir, const char* suffix) {
  return dir.string() + suffix;
}

// A new file (created or truncated) written through write(2). write() never
// throws: it keeps the first error and drops what follows, so that it can
// serve LibTorch's archive writer. finish() puts the bytes on disk (fsync)
// and throws that first error, naming the file; a CheckedFile not finished,
// or whose finish() failed, removes its file. The bytes are hashed as they
// go (XXH64, a large piece on a thread of its own beside its write(2):
// HashBeside), and finish() returns the file's digest for a checkpoint's
// manifest.
class CheckedFile {
 public:
  explicit CheckedFile(std::filesystem::path path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw_errno("cannot create", path_);
  }
  CheckedFile(const CheckedFile&) = delete;
  CheckedFile& operator=(const CheckedFile&) = delete;
  ~CheckedFile() {
    if (fd_ < 0) return;
    ::close(fd_);
    ::unlink(path_.c_str());
  }

  void write(const void* data, std::size_t n) noexcept {
    if (n >= kBuffer) {  // large (a tensor's bytes): straight to the file
      flush();
      put(data, n);
      return;
    }
    if (buffer_.size() + n > kBuffer) flush();
    buffer_.append(static_cast<const char*>(data), n);
  }
  void write(std::string_view text) noexcept { write(text.data(), text.size()); }

  FileDigest finish() {
    flush();
    if (error_ == 0 && ::fsync(fd_) != 0) error_ = errno;
    if (::close(fd_) != 0 && error_ == 0) error_ = errno;
    fd_ = -1;
    if (error_ != 0) {
      ::unlink(path_.c_str());
      throw_errno("cannot write", path_, error_);
    }
    return {bytes_, hash_.digest()};
  }

 private:
  // LibTorch's archive writer hands over many small pieces (zip headers, names):
  // gathered here into writes of up to kBuffer bytes.
  static constexpr std::size_t kBuffer = std::size_t{1} << 20;
  // From this size a piece is hashed on another thread (below it, the handover costs more than it saves).
  static constexpr std::size_t kBeside = std::size_t{256} << 10;

  void flush() noexcept {
    put(buffer_.data(), buffer_.size());
    buffer_.clear();
  }
  void put(const void* data, std::size_t n) noexcept {
    // A large piece is hashed beside its write(2), a small one before it.
    const bool beside = file_digests_on() && n >= kBeside;
    if (beside) beside_.start(data, n);
    else if (file_digests_on()) hash_.update(data, n);
    write_out(data, n);
    if (beside) beside_.wait();
  }
  void write_out(const void* data, std::size_t n) noexcept {
    bytes_ += n;
    const char* p = static_cast<const char*>(data);
    while (n > 0 && error_ == 0) {
      const ssize_t wrote = ::write(fd_, p, n);
      if (wrote < 0) {
        if (errno != EINTR) error_ = errno;
        continue;
      }
      p += wrote;
      n -= static_cast<std::size_t>(wrote);
    }
  }

  std::filesystem::path path_;
  int fd_ = -1;
  int error_ = 0;
  std::string buffer_;
  Xxh64 hash_;
  HashBeside beside_{hash_};
  uint64_t bytes_ = 0;
};

// A whole file's bytes written to `path` through a temporary name and a
// rename: a reader finds the old file or the whole new one. On an error the
// temporary file is removed and the old file stays. Returns its digest.
inline FileDigest write_file_atomically(const std::filesystem::path& path,
                                        const std::function<void(CheckedFile&)>& body) {
  const std::filesystem::path tmp = sibling(path, ".tmp");
  FileDigest digest;
  {
    CheckedFile out(tmp);
    body(out);
    digest = out.finish();
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(tmp.c_str());
    throw_errno("cannot rename " + tmp.string() + " to", path, error);
  }
  return digest;
}

// One archive written and flushed to disk. The writer returns every size as
// written, whatever happened: a short count would make LibTorch's writer
// throw from its destructor (pytorch#156955); finish() reports the error.
inline FileDigest save_archive(torch::serialize::OutputArchive& archive, const std::filesystem::path& path) {
  CheckedFile out(path);
  archive.save_to([&](const void* data, std::size_t n) -> std::size_t {
    out.write(data, n);
    return n;
  });
  return out.finish();
}
}  // namespace detail

ACCEL_NAMESPACE_END
