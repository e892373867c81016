#include "gguf_meta.h"

#include "error.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace dflash {

MappedFile::MappedFile(const char * path, const char * what) {
    const int fd = open(path, O_RDONLY);
    if (fd < 0) {
        fail(DFLASH_ERR_IO, "%s '%s': %s", what, path, strerror(errno));
    }
    struct stat st {};
    if (fstat(fd, &st) != 0) {
        close(fd);
        fail(DFLASH_ERR_IO, "%s '%s': %s", what, path, strerror(errno));
    }
    size = size_t(st.st_size);
    addr = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (addr == MAP_FAILED) {
        addr = nullptr;
        fail(DFLASH_ERR_IO, "cannot map %s '%s': %s", what, path, strerror(errno));
    }
}

MappedFile::~MappedFile() {
    if (addr) {
        munmap(addr, size);
    }
}

}  // namespace dflash
