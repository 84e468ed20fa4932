// Knobs the ISA kernel sets read from the environment (on every *_kernels() call, so that one process can compare
// settings). Plain C++ like kernels.h: the kernel folders have no ATen; a bad value throws std::invalid_argument,
// which the op reports as an error.
#pragma once

#include <cerrno>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace kt::kernels {

// A count in [0, most] from the variable `name`, or `fallback` when it is unset or empty.
inline int env_small(const char* name, int fallback, int most) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(env, &end, 10);
  if (end == env || *end != '\0' || errno != 0 || v < 0 || v > most)
    throw std::invalid_argument(std::string(name) + " must be a count from 0 to " + std::to_string(most) + "; got '" +
                                env + "'");
  return static_cast<int>(v);
}

}  // namespace kt::kernels
