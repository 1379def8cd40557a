// The MPI transport's extension module. It is separate from _jaxring because it links the MPI
// library: jaxring imports it only after mpi4py has loaded that library, and checks that both
// are the same one. It hands each transport to _jaxring as a capsule.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <mpi.h>

#include <cstdint>
#include <stdexcept>

#include "transports/mpi.h"

namespace nb = nanobind;

namespace {

// The MPI implementation whose mpi.h this module was compiled with.
std::string HeaderFamily() {
#if defined(MPICH_VERSION)
  return "MPICH " MPICH_VERSION;
#elif defined(OMPI_MAJOR_VERSION)
  return "Open MPI " + std::to_string(OMPI_MAJOR_VERSION) + "." +
         std::to_string(OMPI_MINOR_VERSION) + "." + std::to_string(OMPI_RELEASE_VERSION);
#else
  return "MPI " + std::to_string(MPI_VERSION) + "." + std::to_string(MPI_SUBVERSION);
#endif
}

}  // namespace

NB_MODULE(_jaxring_mpi, m) {
  m.doc() = "jaxring's MPI transport (links the MPI library)";

  m.def("built_with", &HeaderFamily, "The MPI implementation of the mpi.h used at build time.");
  m.def("library_version", []() {
    char text[MPI_MAX_LIBRARY_VERSION_STRING];
    int length = 0;
    MPI_Get_library_version(text, &length);
    return std::string(text, length);
  }, "MPI_Get_library_version of the MPI library this module is linked with.");

  m.def(
      "create",
      [](uintptr_t comm_address, const std::string& name) {
        // mpi4py's MPI._addressof(comm): the address of its MPI_Comm handle, whatever its type.
        const MPI_Comm parent = *reinterpret_cast<const MPI_Comm*>(comm_address);
        std::unique_ptr<jaxring::MpiTransport> transport;
        jaxring::Status status = jaxring::MpiTransport::Create(parent, name, &transport);
        if (!status.ok()) throw std::runtime_error(status.message());
        jaxring::ProcessTransport* owned = transport.release();
        return nb::capsule(owned, "jaxring.ProcessTransport");
      },
      nb::arg("comm_address"), nb::arg("name"),
      "Duplicates the communicator at `comm_address` (collective) and returns its transport for "
      "_jaxring.process_register.");
}
