# Locate the pinned llama.cpp source tree.
#
# llama.cpp is never vendored in this repository. By default we take it from the
# llama-cpp-python sdist on PyPI (its vendor/llama.cpp is a fixed llama.cpp commit that has
# DFlash/DFlash2 and the llama_set_embeddings_layer_inp staging API): pip downloads the sdist,
# we check its sha256 and extract only vendor/llama.cpp into a git-ignored cache.
# Set LLAMA_CPP_SOURCE_DIR (CMake variable or environment) to use an existing tree instead.

set(PYDFLASH_LLAMA_SDIST_NAME    "llama-cpp-python")
set(PYDFLASH_LLAMA_SDIST_VERSION "0.3.36")
set(PYDFLASH_LLAMA_SDIST_SHA256  "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
set(PYDFLASH_LLAMA_COMMIT        "0c1e57098bba43ac29e6e3b677cdceebdd22334f")

function(pydflash_llama_cpp_source_dir out_var)
    if (NOT LLAMA_CPP_SOURCE_DIR AND DEFINED ENV{LLAMA_CPP_SOURCE_DIR})
        set(LLAMA_CPP_SOURCE_DIR "$ENV{LLAMA_CPP_SOURCE_DIR}")
    endif()
    if (LLAMA_CPP_SOURCE_DIR)
        if (NOT EXISTS "${LLAMA_CPP_SOURCE_DIR}/src/llama-ext.h")
            message(FATAL_ERROR "LLAMA_CPP_SOURCE_DIR=${LLAMA_CPP_SOURCE_DIR} is not a llama.cpp tree "
                                "with src/llama-ext.h (pydflash needs llama_set_embeddings_layer_inp).")
        endif()
        message(STATUS "pydflash: using llama.cpp from LLAMA_CPP_SOURCE_DIR=${LLAMA_CPP_SOURCE_DIR}")
        set(${out_var} "${LLAMA_CPP_SOURCE_DIR}" PARENT_SCOPE)
        return()
    endif()

    if (DEFINED ENV{PYDFLASH_BUILD_CACHE})
        set(cache "$ENV{PYDFLASH_BUILD_CACHE}")
    else()
        set(cache "${PROJECT_SOURCE_DIR}/.cache")
    endif()
    set(tag      "${PYDFLASH_LLAMA_SDIST_NAME}-${PYDFLASH_LLAMA_SDIST_VERSION}")
    set(tree     "${cache}/${tag}/vendor/llama.cpp")
    set(stamp    "${cache}/${tag}/.extracted-${PYDFLASH_LLAMA_SDIST_SHA256}")
    if (EXISTS "${stamp}")
        set(${out_var} "${tree}" PARENT_SCOPE)
        return()
    endif()

    set(dl "${cache}/dl")
    set(archive "${dl}/llama_cpp_python-${PYDFLASH_LLAMA_SDIST_VERSION}.tar.gz")
    if (EXISTS "${archive}")
        file(SHA256 "${archive}" have)
        if (NOT have STREQUAL PYDFLASH_LLAMA_SDIST_SHA256)
            file(REMOVE "${archive}")
        endif()
    endif()
    if (NOT EXISTS "${archive}")
        message(STATUS "pydflash: downloading ${PYDFLASH_LLAMA_SDIST_NAME}==${PYDFLASH_LLAMA_SDIST_VERSION} sdist (llama.cpp ${PYDFLASH_LLAMA_COMMIT})")
        execute_process(
            COMMAND "${Python_EXECUTABLE}" -m pip download --no-deps --no-build-isolation
                    --no-binary ${PYDFLASH_LLAMA_SDIST_NAME} -d "${dl}"
                    "${PYDFLASH_LLAMA_SDIST_NAME}==${PYDFLASH_LLAMA_SDIST_VERSION}"
            RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
        if (NOT rc EQUAL 0 OR NOT EXISTS "${archive}")
            message(FATAL_ERROR "pydflash: could not download the llama-cpp-python sdist with pip "
                                "(${rc}):\n${err}\nSet LLAMA_CPP_SOURCE_DIR to an existing llama.cpp "
                                "tree (commit ${PYDFLASH_LLAMA_COMMIT}) to build offline.")
        endif()
        file(SHA256 "${archive}" have)
        if (NOT have STREQUAL PYDFLASH_LLAMA_SDIST_SHA256)
            file(REMOVE "${archive}")
            message(FATAL_ERROR "pydflash: sha256 mismatch for ${archive}: got ${have}, "
                                "expected ${PYDFLASH_LLAMA_SDIST_SHA256}")
        endif()
    endif()

    message(STATUS "pydflash: extracting vendor/llama.cpp into ${cache}/${tag}")
    set(tmp "${cache}/${tag}.tmp")
    file(REMOVE_RECURSE "${tmp}" "${cache}/${tag}")
    file(ARCHIVE_EXTRACT INPUT "${archive}" DESTINATION "${tmp}"
         PATTERNS "llama_cpp_python-${PYDFLASH_LLAMA_SDIST_VERSION}/vendor/llama.cpp")
    file(RENAME "${tmp}/llama_cpp_python-${PYDFLASH_LLAMA_SDIST_VERSION}" "${cache}/${tag}")
    file(REMOVE_RECURSE "${tmp}")
    file(WRITE "${stamp}" "${PYDFLASH_LLAMA_COMMIT}\n")
    set(${out_var} "${tree}" PARENT_SCOPE)
endfunction()
