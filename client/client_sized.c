/* libzerod: the structs that cross the API and carry their own size
 * (struct_size, set by the ZD_*_INIT initialisers of zerod.h), which is
 * what lets zerod.h add fields to them without a new soname (docs/client.md,
 * "ABI policy").
 *
 * Inputs (options, descriptions) are copied into a zeroed struct of this
 * library's size: fields the caller's older header lacks read as zero, the
 * documented default; a caller whose struct is larger than this library's
 * asked for something this library cannot do and is refused. Arrays of
 * inputs (tensor descriptions, parameter groups) are walked with the first
 * element's struct_size as the stride, the caller's sizeof.
 *
 * Outputs are filled in a struct of this library's size and copied out up
 * to the caller's struct_size and no further: a caller built against an
 * older header, whose struct ends earlier, never has a byte past its
 * struct written. A caller whose struct is larger expects fields this
 * library cannot fill, and is refused like a larger input. The size is
 * checked when the call starts, before any request goes out, so a refused
 * struct never leaves a call half done. */
#include "client_impl.h"

static size_t struct_size_of(const void *sized) {
  size_t struct_size;
  memcpy(&struct_size, sized, sizeof struct_size);
  return struct_size;
}

zd_status client__copy_sized_struct(void *dst, size_t dst_bytes, const void *src, size_t min_bytes,
                                    const char *what, const char *initialiser) {
  size_t src_bytes = struct_size_of(src);
  if (src_bytes < min_bytes)
    return client__set_error(
        ZD_E_INVALID_ARGUMENT,
        "%s: struct_size %zu is too small (at least %zu); initialise it with %s", what, src_bytes,
        min_bytes, initialiser);
  if (src_bytes > dst_bytes)
    return client__set_error(
        ZD_E_INVALID_ARGUMENT,
        "%s: struct_size %zu is larger than this libzerod knows (%zu); the program "
        "was built against a newer zerod.h",
        what, src_bytes, dst_bytes);
  memset(dst, 0, dst_bytes);
  memcpy(dst, src, src_bytes);
  return ZD_OK;
}

zd_status client__sized_array_stride(const void *array, unsigned count, size_t min_bytes,
                                     size_t max_bytes, const char *what, const char *array_name,
                                     const char *initialiser, size_t *stride_out) {
  *stride_out = 0;
  if (count == 0)
    return ZD_OK;
  size_t stride = struct_size_of(array);
  if (stride < min_bytes)
    return client__set_error(
        ZD_E_INVALID_ARGUMENT,
        "%s: %s[0].struct_size %zu is too small (at least %zu); initialise every element "
        "with %s",
        what, array_name, stride, min_bytes, initialiser);
  if (stride > max_bytes)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "%s: %s[0].struct_size %zu is larger than this libzerod knows (%zu); "
                             "the program was built against a newer zerod.h",
                             what, array_name, stride, max_bytes);
  /* The stride is the caller's sizeof only if every element says so; an
   * element left uninitialised would otherwise be read at the wrong
   * offsets without a word. */
  for (unsigned i = 1; i < count; i++) {
    size_t element_size = struct_size_of((const char *)array + (size_t)i * stride);
    if (element_size != stride)
      return client__set_error(ZD_E_INVALID_ARGUMENT,
                               "%s: %s[%u].struct_size is %zu, %s[0]'s is %zu; initialise every "
                               "element with %s",
                               what, array_name, i, element_size, array_name, stride, initialiser);
  }
  *stride_out = stride;
  return ZD_OK;
}

void client__sized_array_element(void *dst, size_t dst_bytes, const void *array, size_t stride,
                                 unsigned index) {
  memset(dst, 0, dst_bytes);
  memcpy(dst, (const char *)array + (size_t)index * stride,
         stride < dst_bytes ? stride : dst_bytes);
}

zd_status client__sized_out_check(const void *out, size_t min_bytes, size_t max_bytes,
                                  const char *what, const char *initialiser) {
  size_t struct_size = struct_size_of(out);
  if (struct_size < min_bytes)
    return client__set_error(
        ZD_E_INVALID_ARGUMENT,
        "%s: out->struct_size %zu is too small (at least %zu); initialise it with %s", what,
        struct_size, min_bytes, initialiser);
  if (struct_size > max_bytes)
    return client__set_error(ZD_E_INVALID_ARGUMENT,
                             "%s: out->struct_size %zu is larger than this libzerod knows (%zu): "
                             "a program built against a newer zerod.h, or a struct not "
                             "initialised with %s",
                             what, struct_size, max_bytes, initialiser);
  return ZD_OK;
}

void client__sized_out_write(void *out, const void *full, size_t full_bytes) {
  size_t struct_size = struct_size_of(out);
  size_t end = struct_size < full_bytes ? struct_size : full_bytes;
  if (end > sizeof struct_size)
    memcpy((char *)out + sizeof struct_size, (const char *)full + sizeof struct_size,
           end - sizeof struct_size);
}
