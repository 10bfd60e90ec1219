/* Linked into the binaries of gpu-bundle/ (tools/gpu_bundle.sh) only.
 *
 * LLVM's Support library, linked statically, calls arc4random, which glibc has only since 2.36
 * (Debian 12, where the bundle is built); the GPU machines' images may have an older glibc
 * (Ubuntu 22.04: 2.35). Defining it here keeps the binaries' newest glibc requirement at 2.34.
 */
#include <stdint.h>
#include <sys/random.h>

uint32_t arc4random(void) {
  uint32_t value = 0;
  while (getrandom(&value, sizeof value, 0) != (ssize_t)sizeof value) {
  }
  return value;
}
