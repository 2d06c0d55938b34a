# Sourced by the device scripts: CuPy's kernel cache kept between device calls. A fresh machine
# compiles every kernel part with NVRTC (~2 min on 16 cores) unless the cache comes along: save
# it into $OUT (`save_cupy_cache`), copy the returned file to .carry/cupy_cache.tgz here, and name
# .carry/cupy_cache.tgz in the next call's `carry`. Entries are keyed by each program's text and
# options, so a changed kernel or another arch compiles afresh; H100 and H200 share sm_90a.
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache}
if [ -f .carry/cupy_cache.tgz ] && [ ! -d "$CUPY_CACHE_DIR" ]; then
  mkdir -p "$(dirname "$CUPY_CACHE_DIR")"
  tar xzf .carry/cupy_cache.tgz -C "$(dirname "$CUPY_CACHE_DIR")" \
    && echo "CuPy cache: $(ls "$CUPY_CACHE_DIR" | wc -l) entries from .carry/cupy_cache.tgz"
fi
save_cupy_cache() {  # into $OUT, for the next call's carry (a few MB)
  [ -d "$CUPY_CACHE_DIR" ] && tar czf "${OUT:-/tmp}/cupy_cache.tgz" \
    -C "$(dirname "$CUPY_CACHE_DIR")" "$(basename "$CUPY_CACHE_DIR")"
}
