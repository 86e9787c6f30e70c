/* ckpt: the on-disk checkpoint formats (docs/architecture.md,
 * docs/checkpoints.md): shard files, manifest.json, and safetensors.
 *
 * Nothing here knows about jobs, ranks or threads: the daemon's ranks
 * write and read shard files with it, the coordinator writes and reads
 * manifests, and zerodctl exports and verifies checkpoints. Every function
 * is reentrant; a writer or reader belongs to one thread at a time.
 *
 * A checkpoint directory holds manifest.json and one shard file per rank
 * of the world that saved it, named ckpt_shard_name(rank, world).
 *
 * Shard file (little-endian):
 *   header   CKPT_HEADER_BYTES: magic "ZDSHARD\0", format version, rank,
 *            world size, job id, step, data bytes, block bytes, and the
 *            XXH64 of the header's other bytes
 *   data     data_bytes: for each unit of the manifest, in manifest order,
 *            each state the manifest lists (master, then moment1, moment2
 *            where present), shard_numel fp32 values; then, in a
 *            checkpoint of a job that compresses its cross-node gradient
 *            sums (feedback.kind set), for each unit in order, the rank's
 *            compression state for it (error feedback, warm start):
 *            feedback.numel[u] fp32 values (docs/compression.md)
 *   table    one XXH64 per CKPT_BLOCK_BYTES block of data (the last block
 *            may be short)
 *   footer   8 bytes: XXH64 of the table
 * The manifest records each file's size and the XXH64 of the whole file.
 * A reader that needs part of a file checks the header, the table, and the
 * blocks it reads, so a restore that re-shards verifies every byte it uses
 * without reading whole files; ckpt_file_verify checks a whole file.
 *
 * Errors: negative errno values, with a message in err that names the file
 * (its base name) and what is wrong: -EIO (a read or write failed; ENOSPC
 * and friends are passed through as they are), -EBADMSG (checksum
 * mismatch, bad magic, malformed manifest or header), -ERANGE (a size or
 * offset out of bounds, a truncated file). */
#ifndef ZEROD_CKPT_H
#define ZEROD_CKPT_H

#include <stddef.h>
#include <stdint.h>

#define CKPT_FORMAT_VERSION 1 /* shard files */
/* manifest.json: version 2 added "tenant", version 3 "feedback"
 * (optional); versions 1 and 2 are still read (tenant "", no feedback). */
#define CKPT_MANIFEST_VERSION 3
#define CKPT_TENANT_MAX_BYTES 64 /* as a principal's tenant (coord/auth.h) */
#define CKPT_HEADER_BYTES     4096u
#define CKPT_BLOCK_BYTES      (1u << 20)
#define CKPT_MANIFEST_NAME    "manifest.json"
#define CKPT_MAX_TENSOR_DIM   8
/* Refused above this: a manifest is small (units and tensors), and
 * safetensors caps its header at 100 MB. */
#define CKPT_MAX_MANIFEST_BYTES  (64u << 20)
#define CKPT_MAX_ST_HEADER_BYTES (100u << 20)

/* XXH64 with seed 0 (libxxhash), incremental. */
typedef struct ckpt_hash ckpt_hash;
ckpt_hash *ckpt_hash_new(void);
void ckpt_hash_update(ckpt_hash *h, const void *data, size_t bytes);
uint64_t ckpt_hash_digest(const ckpt_hash *h);
void ckpt_hash_free(ckpt_hash *h);
uint64_t ckpt_hash_once(const void *data, size_t bytes);

/* "rank-00003-of-00004.zdshard" into out (at least 32 bytes). */
void ckpt_shard_name(uint32_t rank, uint32_t world_size, char *out, size_t out_bytes);

/* ---- manifest.json -------------------------------------------------------- */

typedef enum ckpt_state { CKPT_MASTER = 0, CKPT_MOMENT1 = 1, CKPT_MOMENT2 = 2 } ckpt_state;

typedef struct ckpt_tensor {
  char *name;
  uint64_t shape[CKPT_MAX_TENSOR_DIM];
  unsigned ndim;
  uint64_t numel;  /* product of shape (1 for ndim 0) */
  uint64_t offset; /* elements from the start of the unit's flat buffer */
  int frozen;
} ckpt_tensor;

typedef struct ckpt_unit {
  char *name;
  unsigned ntensors;
  ckpt_tensor *tensors;  /* by offset, not overlapping, within numel */
  uint64_t numel;        /* end of the last tensor */
  uint64_t padded_numel; /* shard_numel * world_size, >= numel */
  uint64_t shard_numel;
} ckpt_unit;

typedef struct ckpt_file_entry {
  char *name; /* ckpt_shard_name(rank, world_size) */
  uint64_t bytes;
  uint64_t xxh64;
} ckpt_file_entry;

/* The state of a job's compressed cross-node gradient sums (1-bit Adam's
 * error feedback, low-rank compression's error feedback and warm start),
 * saved after the states: kind "onebit" or "powersgd" ("" none, nodes 0,
 * numel NULL), made on `nodes` nodes of world_size ranks (nodes divides
 * it), numel[u] fp32 values per rank for unit u (0: none for that unit).
 * It belongs to the rank and the layout that made it, so only a restore
 * into the same world, nodes and kind takes it. */
#define CKPT_FEEDBACK_KIND_MAX 15
typedef struct ckpt_feedback {
  char kind[CKPT_FEEDBACK_KIND_MAX + 1];
  uint32_t nodes;
  uint64_t *numel; /* [nunits] (malloc'd) */
} ckpt_feedback;

/* The job's optimizer and precision, as saved (strings as in JobConfig's
 * documentation: "adamw", "adam", "sgd"; "fp32", "bf16"). */
typedef struct ckpt_config {
  char optimizer[16];
  double lr, beta1, beta2, eps, weight_decay;
  double momentum, dampening;
  int nesterov;
  char working_dtype[8];
  double max_grad_norm;
} ckpt_config;

typedef struct ckpt_manifest {
  uint32_t format_version; /* as read: 1 or CKPT_MANIFEST_VERSION; written: the latter */
  char *job;               /* the saving job's name */
  uint64_t job_id;
  /* The tenant that owns the checkpoint (its job's), "" for a job of no
   * tenant and in a version 1 manifest. The coordinator sets it and the
   * job id at the commit; what a node writes in the layout is replaced. */
  char tenant[CKPT_TENANT_MAX_BYTES + 1];
  char *name; /* the checkpoint's name */
  int64_t created_unix_ms;
  uint64_t step;    /* completed optimizer steps */
  uint64_t version; /* the job's parameter version */
  uint32_t world_size;
  ckpt_config config;
  int has_moment1, has_moment2; /* states saved besides the master weights */
  ckpt_feedback feedback;
  unsigned nunits;
  ckpt_unit *units;       /* in unit id order */
  ckpt_file_entry *files; /* [world_size], by rank */
} ckpt_manifest;

/* The number of states per unit (1 + has_moment1 + has_moment2). */
unsigned ckpt_nstates(const ckpt_manifest *m);
/* Bytes of data in each rank's shard file: sum over units of
 * shard_numel * 4 * ckpt_nstates, plus 4 * the feedback's numel. */
uint64_t ckpt_shard_data_bytes(const ckpt_manifest *m);
/* Offset in the data region of unit u's feedback (feedback.numel[u]
 * floats), -1 if the manifest has none or no unit u. */
int64_t ckpt_feedback_offset(const ckpt_manifest *m, unsigned unit);
/* Offset in the data region of unit u's state s (a state the manifest has):
 * where that unit's shard_numel floats of that state start. -1 if absent. */
int64_t ckpt_data_offset(const ckpt_manifest *m, unsigned unit, ckpt_state state);
/* The size a complete shard file of m has (header + data + table + footer). */
uint64_t ckpt_shard_file_bytes(const ckpt_manifest *m);

/* JSON text of m (malloc'd, NUL-terminated, *len without the NUL), or NULL
 * if out of memory. Deterministic: the same manifest gives the same bytes. */
char *ckpt_manifest_encode(const ckpt_manifest *m, size_t *len);
/* Parses and validates everything (types, ranges, names, that tensors fit
 * their units and do not overlap, padded_numel == shard_numel * world,
 * files == world_size with the right names). On failure nothing is left
 * allocated. */
#define CKPT_DECODE_NO_FILES 1 /* a layout: files absent (nfiles 0), see below */
int ckpt_manifest_decode(const char *text, size_t len, int flags, ckpt_manifest *out, char *err,
                         size_t err_bytes);
void ckpt_manifest_free(ckpt_manifest *m);
/* Reads dir/file (CKPT_MANIFEST_NAME, or CKPT_LAYOUT_NAME with
 * CKPT_DECODE_NO_FILES; at most CKPT_MAX_MANIFEST_BYTES) and decodes it. */
int ckpt_manifest_load(const char *dir, const char *file, int flags, ckpt_manifest *out, char *err,
                       size_t err_bytes);
/* Writes dir/file (write to a temporary name, fsync, rename, fsync dir),
 * mode filemode_file() (default 0600).
 * A manifest with files == NULL is written without its "files" (a layout). */
int ckpt_manifest_store(const char *dir, const char *file, const ckpt_manifest *m, char *err,
                        size_t err_bytes);

/* During a save, rank 0 writes the job's layout (a manifest without files:
 * job, config, step, units) here in the temporary directory; the
 * coordinator adds the files the ranks reported, writes manifest.json and
 * removes the layout before it renames the directory. */
#define CKPT_LAYOUT_NAME "layout.json"

/* ---- Shard files ----------------------------------------------------------- */

typedef struct ckpt_shard_header {
  uint32_t rank, world_size;
  uint64_t job_id;
  uint64_t step;
  uint64_t data_bytes;
} ckpt_shard_header;

/* Writes one shard file sequentially with pwrite: the header now, data as
 * it comes (any chunk sizes), then the table and footer at finish, which
 * also fsyncs the file. The file is created with O_EXCL | O_NOFOLLOW, mode
 * filemode_file() (default 0600). */
typedef struct ckpt_writer ckpt_writer;
int ckpt_writer_open(const char *path, const ckpt_shard_header *h, ckpt_writer **out, char *err,
                     size_t err_bytes);
/* Appends data; more than the header's data_bytes in all is -ERANGE. */
int ckpt_writer_write(ckpt_writer *w, const void *data, size_t bytes, char *err, size_t err_bytes);
/* Requires exactly data_bytes written. Returns the file's size and XXH64,
 * closes it and frees w (on failure too). */
int ckpt_writer_finish(ckpt_writer *w, uint64_t *file_bytes, uint64_t *file_xxh64, char *err,
                       size_t err_bytes);
/* Closes, unlinks the file and frees w. */
void ckpt_writer_abort(ckpt_writer *w);

/* Reads parts of one shard file, verifying each block it touches. open
 * checks the size against expect_bytes (-ERANGE: "truncated" or "too long"),
 * the header (magic, version, its checksum, rank/world_size/data_bytes
 * equal to expect's) and the table against the footer. */
typedef struct ckpt_reader ckpt_reader;
int ckpt_reader_open(const char *path, uint64_t expect_bytes, const ckpt_shard_header *expect,
                     ckpt_reader **out, char *err, size_t err_bytes);
/* Copies data bytes [offset, offset + bytes) into dst. Every block the
 * range touches is read whole and checked (-EBADMSG names the block). */
int ckpt_reader_read(ckpt_reader *r, uint64_t offset, void *dst, size_t bytes, char *err,
                     size_t err_bytes);
const ckpt_shard_header *ckpt_reader_header(const ckpt_reader *r);
void ckpt_reader_close(ckpt_reader *r);

/* Reads the whole file and checks its size and XXH64 against the manifest's
 * entry, then the header, table and blocks as a reader would. */
int ckpt_file_verify(const char *dir, const ckpt_file_entry *entry, char *err, size_t err_bytes);

/* ---- Reading a checkpoint by ranges (restore, export) -------------------- */

/* A checkpoint directory opened for reading: its manifest, loaded and
 * validated, and a reader per shard file opened on first use (each checked
 * against the manifest's size for it). One thread at a time. */
typedef struct ckpt_source ckpt_source;
int ckpt_source_open(const char *dir, ckpt_source **out, char *err, size_t err_bytes);
const ckpt_manifest *ckpt_source_manifest(const ckpt_source *s);
/* Reads elements [from, to) of the flat buffer of the manifest's unit
 * `unit` (0 <= from <= to <= padded_numel) for state (one the manifest
 * has) into dst, from whichever ranks' files hold them. */
int ckpt_source_read(ckpt_source *s, unsigned unit, ckpt_state state, uint64_t from, uint64_t to,
                     float *dst, char *err, size_t err_bytes);
/* Reads rank's feedback for unit (feedback.numel[unit] floats) from that
 * rank's file into dst. */
int ckpt_source_read_feedback(ckpt_source *s, unsigned unit, uint32_t rank, float *dst, char *err,
                              size_t err_bytes);
void ckpt_source_close(ckpt_source *s);

/* ---- safetensors ----------------------------------------------------------- *
 * https://huggingface.co/docs/safetensors: 8 bytes little-endian N, N bytes
 * of JSON header {"name": {"dtype", "shape", "data_offsets": [b, e]}, ...,
 * optional "__metadata__": {str: str}}, then the data; offsets are relative
 * to the data's start. */

typedef enum st_dtype {
  ST_F32 = 0,
  ST_BF16 = 1,
  ST_F16 = 2,
  ST_F64 = 3,
  ST_OTHER = 4 /* any other valid dtype (I8, U8, BOOL, ...): listed, not converted */
} st_dtype;

typedef struct st_tensor {
  char *name;
  st_dtype dtype;
  char dtype_name[8]; /* as in the file: "F32", "BF16", "I64", ... */
  unsigned elem_bytes;
  uint64_t shape[CKPT_MAX_TENSOR_DIM];
  unsigned ndim;
  uint64_t numel;
  uint64_t begin, end; /* data_offsets */
} st_tensor;

typedef struct st_file {
  unsigned ntensors;
  st_tensor *tensors;  /* sorted by name */
  uint64_t data_start; /* 8 + N: where offsets start in the file */
  uint64_t data_bytes; /* file size - data_start */
} st_file;

/* Decodes a header (the N bytes of JSON) for a file whose data region has
 * data_bytes bytes. Validates: JSON object of objects, known keys only,
 * dtype known, shape a list of at most CKPT_MAX_TENSOR_DIM non-negative
 * integers, end - begin == numel * elem size, offsets within data_bytes and
 * not overlapping, names unique and non-empty. */
int st_header_decode(const char *json, size_t len, uint64_t data_bytes, st_file *out, char *err,
                     size_t err_bytes);
void st_file_free(st_file *f);

/* Opens path, reads and decodes its header (the size prefix at most
 * CKPT_MAX_ST_HEADER_BYTES). The descriptor stays open in *fd for reads. */
int st_open(const char *path, st_file *out, int *fd, char *err, size_t err_bytes);
/* The tensor named name, or NULL. */
const st_tensor *st_find(const st_file *f, const char *name);
/* Reads elements [from, to) of tensor t from fd as fp32 (converting F32,
 * BF16, F16 and F64; ST_OTHER is -EINVAL). */
int st_read_f32(int fd, const st_file *f, const st_tensor *t, uint64_t from, uint64_t to,
                float *dst, char *err, size_t err_bytes);

/* Writes a safetensors file: the header for tensors (name, dtype ST_F32 or
 * ST_BF16, shape; offsets are assigned here, in the given order), padded
 * with spaces to a multiple of 8, then each tensor's data from the
 * callback, which fills numel values of tensor i as fp32 (converted to
 * bf16 here for ST_BF16). st_write_at writes name.tmp in the directory
 * dir_fd (created with O_EXCL | O_NOFOLLOW, a leftover .tmp removed
 * first, mode filemode_file()), fsyncs it, renames it to name with
 * renameat in the same directory, and fsyncs the directory: a symbolic
 * link at name is replaced, never followed. st_write does the same in
 * path's directory. */
typedef int (*st_fill_fn)(void *arg, unsigned i, float *dst, uint64_t numel, char *err,
                          size_t err_bytes);
int st_write_at(int dir_fd, const char *name, const st_tensor *tensors, unsigned ntensors,
                const char *metadata_json, st_fill_fn fill, void *arg, char *err, size_t err_bytes);
int st_write(const char *path, const st_tensor *tensors, unsigned ntensors,
             const char *metadata_json, st_fill_fn fill, void *arg, char *err, size_t err_bytes);

/* ---- Export --------------------------------------------------------------- */

typedef struct ckpt_export_info {
  unsigned tensors; /* written */
  uint64_t bytes;   /* the file's size */
  uint64_t step;    /* the manifest's */
} ckpt_export_info;

/* Writes the master weights of the checkpoint in dir to the safetensors
 * file out_name in the directory out_dir_fd (st_write_at: name.tmp,
 * fsynced, renamed in that directory): every tensor of every
 * unit, in manifest order, named and shaped as registered, as dtype (ST_F32
 * or ST_BF16, rounded to nearest even). Every byte read is checked against
 * the shard files' block checksums. The file's __metadata__ holds "format":
 * "pt", and the job, step and (label non-NULL) checkpoint as zerod.job,
 * zerod.step and zerod.checkpoint. Tensors are filled one at a time, so
 * memory is the largest tensor's fp32 size. */
int ckpt_export(const char *dir, int out_dir_fd, const char *out_name, st_dtype dtype,
                const char *label, ckpt_export_info *out, char *err, size_t err_bytes);

#endif /* ZEROD_CKPT_H */
