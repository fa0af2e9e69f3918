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
    no_copy_source = True

    def export_sources(self):
        # The recipe lives two folders below the sources it packages.
        root = os.path.join(self.recipe_folder, "..", "..")
        for pattern in ("CMakeLists.txt", "LICENSE", "cmake/*", "include/*"):
            copy(self, pattern, root, self.export_sources_folder)

    def layout(self):
        cmake_layout(self)

    def requirements(self):
        # dml's headers include these, so their headers travel to consumers too.
        self.requires("onednn/[>=3.0 <4]", transitive_headers=True)
        self.requires("nlohmann_json/[>=3.11 <4]", transitive_headers=True)
        self.requires("zlib/[>=1.2.11 <2]", transitive_headers=True)

    def package_id(self):
        self.info.clear()

    def generate(self):
        CMakeDeps(self).generate()
        toolchain = CMakeToolchain(self)
        toolchain.cache_variables.update({
            "DML_BUILD_TESTS": False,
            "DML_BUILD_EXAMPLES": False,
            "DML_BUILD_BENCHMARKS": False,
            "DML_ENABLE_CUDA": False,
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
        self.cpp_info.set_property("cmake_target_name", "dml::dml")
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
        self.cpp_info.requires = ["onednn::onednn", "nlohmann_json::nlohmann_json", "zlib::zlib"]
        if self.settings.compiler in ("gcc", "clang"):
            self.cpp_info.cxxflags = ["-fopenmp"]
            self.cpp_info.exelinkflags = ["-fopenmp"]
            self.cpp_info.sharedlinkflags = ["-fopenmp"]
        # Thrust and CUB (host back ends) come from the CUDA toolkit on the consumer's machine.
        cccl = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include", "cccl")
        if os.path.isdir(cccl):
            self.cpp_info.includedirs.append(cccl)
