# Builds and installs libinfer as a system package.
#
#   make                                  # cargo build --release (the library and infer-perf)
#   make install [PREFIX=/usr/local] [DESTDIR=/staging] [NO_BUILD=1]
#   make install-strip                    # the same, without the debug information
#   make install ORT_LIBRARY=/path/libonnxruntime.so.1.32.0   # also places ONNX Runtime
#                                         # beside libinfer.so (where it is looked for)
#   make uninstall [PREFIX=...] [DESTDIR=...]
#   make test-package                     # scripts/test_package.sh
#   make memcheck                         # scripts/test_memcheck.sh
#
# Installs, under PREFIX:
#   lib/libinfer.so.VERSION, lib/libinfer.so.SOVERSION -> it, lib/libinfer.so -> that
#   lib/libinfer.a
#   bin/infer-perf (the measuring tool, tools/infer-perf; the library is linked into it)
#   include/infer.h, include/infer/*.hpp (the C++ binding in bindings/cpp/include/infer/,
#       with infer.hpp including the rest; when the checkout has it)
#   lib/pkgconfig/infer.pc, lib/pkgconfig/infer-static.pc
#   lib/cmake/infer/{inferConfig,inferConfigVersion,inferTargets}.cmake
# from the templates in packaging/. LIBDIR, INCLUDEDIR, PKGCONFIGDIR and CMAKEDIR move
# single parts. VERSION comes from Cargo.toml, SOVERSION from the soname set in build.rs.

PREFIX       ?= /usr/local
BINDIR       ?= $(PREFIX)/bin
LIBDIR       ?= $(PREFIX)/lib
INCLUDEDIR   ?= $(PREFIX)/include
PKGCONFIGDIR ?= $(LIBDIR)/pkgconfig
CMAKEDIR     ?= $(LIBDIR)/cmake/infer
DESTDIR      ?=

CARGO   ?= cargo
INSTALL ?= install
STRIP   ?= strip

TARGET_DIR := $(or $(CARGO_TARGET_DIR),target)
LIB_SO     := $(TARGET_DIR)/release/libinfer.so
LIB_A      := $(TARGET_DIR)/release/libinfer.a
PERF_BIN   := $(TARGET_DIR)/release/infer-perf
GEN_DIR    := $(TARGET_DIR)/packaging

# The C++ binding's headers (header-only); installed under INCLUDEDIR/infer/ when present.
CPP_INCLUDE := bindings/cpp/include

VERSION       := $(shell sed -n 's/^version *= *"\([^"]*\)".*/\1/p' Cargo.toml | head -n 1)
VERSION_MAJOR := $(firstword $(subst ., ,$(VERSION)))
SOVERSION     := $(shell sed -n 's/.*-soname,libinfer\.so\.\([0-9][0-9]*\).*/\1/p' build.rs | head -n 1)
DESCRIPTION   := $(shell sed -n 's/^description *= *"\([^"]*\)".*/\1/p' Cargo.toml | head -n 1)

# What a program linking libinfer.a needs besides it: the system libraries of the Rust
# standard library, as `cargo rustc --release -- --print native-static-libs` lists them
# for x86_64-unknown-linux-gnu (the dependencies add only static archives, which are
# inside libinfer.a). scripts/test_package.sh links a program with exactly these.
STATIC_LIBS       := -lgcc_s -lutil -lrt -lpthread -lm -ldl -lc
# And a flag: the assembly kernels that tract-linalg puts into libinfer.a have no
# .note.GNU-stack section, so without it ld warns and marks the program's stack
# executable. rustc links libinfer.so with -z noexecstack too; the kernels do not run code
# on the stack.
STATIC_LDFLAGS    := -Wl,-z,noexecstack
empty :=
space := $(empty) $(empty)
STATIC_LIBS_CMAKE := $(subst $(space),;,$(strip $(patsubst -l%,%,$(STATIC_LIBS))))

ifeq ($(VERSION),)
$(error could not read the version from Cargo.toml)
endif
ifeq ($(SOVERSION),)
$(error could not read the soname from build.rs)
endif

.PHONY: all build install install-strip uninstall test-package memcheck help

all: build

build:
	$(CARGO) build --release --workspace

help:
	@sed -n '1,/^$$/s/^# \{0,1\}//p' Makefile

# Relative paths let the CMake package find its files again when the prefix was moved.
REL = $(shell realpath -m --relative-to='$(1)' '$(2)')

# sedq VALUE: VALUE as the replacement of a sed 's|...|...|' inside single quotes.
sedq = $(subst ','\'',$(subst &,\&,$(subst |,\|,$(1))))

# gen TEMPLATE OUTPUT: fills in the @NAME@ placeholders.
define gen
	@echo "-- generating $(2)"
	@sed -e 's|@VERSION@|$(VERSION)|g' \
	    -e 's|@VERSION_MAJOR@|$(VERSION_MAJOR)|g' \
	    -e 's|@SOVERSION@|$(SOVERSION)|g' \
	    -e 's|@DESCRIPTION@|$(call sedq,$(DESCRIPTION))|g' \
	    -e 's|@PREFIX@|$(call sedq,$(PREFIX))|g' \
	    -e 's|@LIBDIR@|$(call sedq,$(LIBDIR))|g' \
	    -e 's|@INCLUDEDIR@|$(call sedq,$(INCLUDEDIR))|g' \
	    -e 's|@CMAKEDIR@|$(call sedq,$(CMAKEDIR))|g' \
	    -e 's|@CMAKEDIR_TO_PREFIX@|$(call sedq,$(call REL,$(CMAKEDIR),$(PREFIX)))|g' \
	    -e 's|@PREFIX_TO_LIBDIR@|$(call sedq,$(call REL,$(PREFIX),$(LIBDIR)))|g' \
	    -e 's|@PREFIX_TO_INCLUDEDIR@|$(call sedq,$(call REL,$(PREFIX),$(INCLUDEDIR)))|g' \
	    -e 's|@STATIC_LIBS@|$(STATIC_LIBS)|g' \
	    -e 's|@STATIC_LDFLAGS@|$(STATIC_LDFLAGS)|g' \
	    -e 's|@STATIC_LIBS_CMAKE@|$(STATIC_LIBS_CMAKE)|g' \
	    $(1) > $(2)
endef

# NO_BUILD=1: install what is built, without running cargo (e.g. `sudo make install
# NO_BUILD=1` after `make` as yourself).
ifeq ($(NO_BUILD),)
install: build
endif

install:
	@case '$(PREFIX)' in /*) ;; *) echo "error: PREFIX must be an absolute path (got '$(PREFIX)')" >&2; exit 1;; esac
	@test -f $(LIB_SO) && test -f $(LIB_A) && test -f $(PERF_BIN) || { echo "error: $(LIB_SO), $(LIB_A) or $(PERF_BIN) missing: run make" >&2; exit 1; }
	mkdir -p $(GEN_DIR)
	$(call gen,packaging/infer.pc.in,$(GEN_DIR)/infer.pc)
	$(call gen,packaging/infer-static.pc.in,$(GEN_DIR)/infer-static.pc)
	$(call gen,packaging/inferConfig.cmake.in,$(GEN_DIR)/inferConfig.cmake)
	$(call gen,packaging/inferConfigVersion.cmake.in,$(GEN_DIR)/inferConfigVersion.cmake)
	$(call gen,packaging/inferTargets.cmake.in,$(GEN_DIR)/inferTargets.cmake)
	$(INSTALL) -d '$(DESTDIR)$(LIBDIR)' '$(DESTDIR)$(INCLUDEDIR)' '$(DESTDIR)$(PKGCONFIGDIR)' '$(DESTDIR)$(CMAKEDIR)' '$(DESTDIR)$(BINDIR)'
	$(INSTALL) -m 0755 $(PERF_BIN) '$(DESTDIR)$(BINDIR)/infer-perf'
	$(INSTALL) -m 0755 $(LIB_SO) '$(DESTDIR)$(LIBDIR)/libinfer.so.$(VERSION)'
	ln -sf libinfer.so.$(VERSION) '$(DESTDIR)$(LIBDIR)/libinfer.so.$(SOVERSION)'
	ln -sf libinfer.so.$(SOVERSION) '$(DESTDIR)$(LIBDIR)/libinfer.so'
	$(INSTALL) -m 0644 $(LIB_A) '$(DESTDIR)$(LIBDIR)/libinfer.a'
	@if [ -n '$(ORT_LIBRARY)' ]; then \
	    echo "$(INSTALL) -m 0755 $(ORT_LIBRARY) $(DESTDIR)$(LIBDIR)/$$(basename '$(ORT_LIBRARY)')"; \
	    $(INSTALL) -m 0755 '$(ORT_LIBRARY)' "$(DESTDIR)$(LIBDIR)/$$(basename '$(ORT_LIBRARY)')" || exit 1; \
	fi
	$(INSTALL) -m 0644 include/infer.h '$(DESTDIR)$(INCLUDEDIR)/infer.h'
	@if [ -d $(CPP_INCLUDE)/infer ]; then \
	    cd $(CPP_INCLUDE) && find infer -type f \( -name '*.hpp' -o -name '*.h' \) | sort | \
	    while read -r f; do \
	        echo "$(INSTALL) -m 0644 $(CPP_INCLUDE)/$$f '$(DESTDIR)$(INCLUDEDIR)/$$f'"; \
	        $(INSTALL) -d "$$(dirname '$(DESTDIR)$(INCLUDEDIR)/'"$$f")" && \
	        $(INSTALL) -m 0644 "$$f" '$(DESTDIR)$(INCLUDEDIR)/'"$$f" || exit 1; \
	    done; \
	else \
	    echo "-- no C++ binding in $(CPP_INCLUDE)/infer: infer/infer.hpp not installed"; \
	fi
	$(INSTALL) -m 0644 $(GEN_DIR)/infer.pc $(GEN_DIR)/infer-static.pc '$(DESTDIR)$(PKGCONFIGDIR)/'
	$(INSTALL) -m 0644 $(GEN_DIR)/inferConfig.cmake $(GEN_DIR)/inferConfigVersion.cmake \
	    $(GEN_DIR)/inferTargets.cmake '$(DESTDIR)$(CMAKEDIR)/'
	@if [ -n '$(INSTALL_STRIP)' ]; then \
	    echo "$(STRIP) --strip-debug $(DESTDIR)$(LIBDIR)/libinfer.so.$(VERSION) $(DESTDIR)$(LIBDIR)/libinfer.a $(DESTDIR)$(BINDIR)/infer-perf"; \
	    $(STRIP) --strip-debug '$(DESTDIR)$(LIBDIR)/libinfer.so.$(VERSION)' '$(DESTDIR)$(LIBDIR)/libinfer.a' '$(DESTDIR)$(BINDIR)/infer-perf'; \
	fi
	@echo "-- installed libinfer $(VERSION) into $(DESTDIR)$(PREFIX)"

install-strip:
	$(MAKE) install INSTALL_STRIP=1

uninstall:
	rm -f '$(DESTDIR)$(LIBDIR)/libinfer.so.$(VERSION)' '$(DESTDIR)$(LIBDIR)/libinfer.so.$(SOVERSION)' \
	    '$(DESTDIR)$(LIBDIR)/libinfer.so' '$(DESTDIR)$(LIBDIR)/libinfer.a' \
	    '$(DESTDIR)$(INCLUDEDIR)/infer.h' \
	    '$(DESTDIR)$(PKGCONFIGDIR)/infer.pc' '$(DESTDIR)$(PKGCONFIGDIR)/infer-static.pc' \
	    '$(DESTDIR)$(CMAKEDIR)/inferConfig.cmake' '$(DESTDIR)$(CMAKEDIR)/inferConfigVersion.cmake' \
	    '$(DESTDIR)$(CMAKEDIR)/inferTargets.cmake' '$(DESTDIR)$(BINDIR)/infer-perf'
	rm -f '$(DESTDIR)$(INCLUDEDIR)/infer/infer.hpp'
	@if [ -d $(CPP_INCLUDE)/infer ]; then \
	    cd $(CPP_INCLUDE) && find infer -type f \( -name '*.hpp' -o -name '*.h' \) | \
	    while read -r f; do rm -f '$(DESTDIR)$(INCLUDEDIR)/'"$$f"; done; \
	fi
	@if [ -d '$(DESTDIR)$(INCLUDEDIR)/infer' ]; then \
	    find '$(DESTDIR)$(INCLUDEDIR)/infer' -depth -type d -empty -delete; fi
	@rmdir '$(DESTDIR)$(CMAKEDIR)' 2>/dev/null || true

test-package:
	scripts/test_package.sh

memcheck:
	scripts/test_memcheck.sh
