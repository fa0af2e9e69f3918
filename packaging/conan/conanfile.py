# SPDX-License-Identifier: Apache-2.0
# Conan 2 recipe for dml (header-only): conan create packaging/conan
import os

from conan import ConanFile
from conan.tools.cmake import CMake, CMakeDeps, CMakeToolchain, cmake_layout
from conan.tools.files import copy


class DmlConan(ConanFile):
    name = "dml"
    version = "0.1.0"
    license = "Apache-2.0"
    description = "Header-only C++20 library for distributed training of neural networks"
    topics = ("deep-learning", "distributed-training", "header-only", "cuda", "mpi")
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    # The components beside dml::dml (cmake/dml-config.cmake.in): mpi from Conan; cuda and nccl from the
    # CUDA toolkit on the machine (Conan has no recipe for it), so those two only declare the targets; gloo from
    # the system too (Conan has no recipe for Gloo either: Debian's libgloo-dev).
    options = {"mpi": [True, False], "gloo": [True, False], "cuda": [True, False], "nccl": [True, False]}
    default_options = {"mpi": False, "gloo": False, "cuda": False, "nccl": False}
    no_copy_source = True

    def export_sources(self):
        # The recipe lives two folders below the sources it packages.
        root = os.path.join(self.recipe_folder, "..", "..")
        for pattern in ("CMakeLists.txt", "LICENSE", "cmake/*", "include/*"):
            copy(self, pattern, root, self.export_sources_folder)

    def layout(self):
        cmake_layout(self)

    def configure(self):
        if self.options.nccl:
            self.options.mpi = True
            self.options.cuda = True

    def requirements(self):
        # dml's headers include these, so their headers travel to consumers too. The ranges are
        # cmake/dml-dependencies.cmake's DML_DEPENDENCY_VERSIONS (scripts/check-recipes compares them).
        self.requires("onednn/[>=2.6 <4]", transitive_headers=True)
        self.requires("nlohmann_json/[>=3.11 <4]", transitive_headers=True)
        self.requires("zlib/[>=1.2.11 <2]", transitive_headers=True)
        self.requires("thrust/[>=1.17 <4]", transitive_headers=True)  # Thrust and CUB headers (CCCL)
        if self.options.mpi:
            self.requires("openmpi/[>=4.1 <6]", transitive_headers=True)

    def package_id(self):
        self.info.clear()

    def generate(self):
        CMakeDeps(self).generate()
        toolchain = CMakeToolchain(self)
        toolchain.cache_variables.update({
            "DML_BUILD_TESTS": False,
            "DML_BUILD_EXAMPLES": False,
            "DML_BUILD_BENCHMARKS": False,
            "DML_ENABLE_CUDA": bool(self.options.cuda),
            "DML_INSTALL": True,
        })
        toolchain.generate()

    def build(self):
        pass  # nothing to compile

    def package(self):
        copy(self, "LICENSE", self.source_folder, os.path.join(self.package_folder, "licenses"))
        cmake = CMake(self)
        cmake.configure()
        cmake.install()

    def package_info(self):
        self.cpp_info.set_property("cmake_file_name", "dml")
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
        # One Conan component per CMake target of dml-config.cmake: dml::dml always, the others with
        # their option (their CMake names are dml::mpi, dml::gloo, dml::cuda, dml::nccl).
        core = self.cpp_info.components["dml"]
        core.set_property("cmake_target_name", "dml::dml")
        core.bindirs = []
        core.libdirs = []
        core.requires = ["onednn::onednn", "nlohmann_json::nlohmann_json", "zlib::zlib", "thrust::thrust"]
        if self.settings.compiler in ("gcc", "clang"):
            core.cxxflags = ["-fopenmp"]
            core.exelinkflags = ["-fopenmp"]
            core.sharedlinkflags = ["-fopenmp"]
        if self.options.mpi:
            mpi = self.cpp_info.components["mpi"]
            mpi.set_property("cmake_target_name", "dml::mpi")
            mpi.requires = ["dml", "openmpi::openmpi"]
        if self.options.gloo:
            gloo = self.cpp_info.components["gloo"]
            gloo.set_property("cmake_target_name", "dml::gloo")
            gloo.requires = ["dml"]
            gloo.system_libs = ["gloo"]
        if self.options.cuda:
            cuda = self.cpp_info.components["cuda"]
            cuda.set_property("cmake_target_name", "dml::cuda")
            cuda.requires = ["dml"]
            cuda.system_libs = ["cudart", "cublas", "cublasLt"]
        if self.options.nccl:
            nccl = self.cpp_info.components["nccl"]
            nccl.set_property("cmake_target_name", "dml::nccl")
            nccl.requires = ["cuda", "mpi"]
            nccl.system_libs = ["nccl"]
