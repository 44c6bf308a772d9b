"""How much device memory a GPU has, asked through Vulkan: for backends whose own API does
not say (WebGPU reports no memory size, and wgpu-native on Linux and Windows runs over
Vulkan, so the same physical device is there to ask)."""
from __future__ import annotations


def device_local_bytes(vendor_id, device_id):
    """Bytes of the largest DEVICE_LOCAL memory heap of the first Vulkan physical device
    with these PCI vendor and device ids; None when there is no Vulkan loader, no such
    device, or the `vulkan` bindings are not installed (the caller keeps its own guess).
    Makes and destroys a Vulkan instance of its own: a few milliseconds, once per device
    start."""
    try:
        import vulkan as vk     # dlopens libvulkan.so.1: OSError without a loader
    except (ImportError, OSError):
        return None
    try:
        app = vk.VkApplicationInfo(pApplicationName="zyx", pEngineName="zyx",
                                   apiVersion=vk.VK_MAKE_VERSION(1, 1, 0))
        instance = vk.vkCreateInstance(vk.VkInstanceCreateInfo(pApplicationInfo=app), None)
    except vk.VkError:
        return None
    try:
        for pd in vk.vkEnumeratePhysicalDevices(instance):
            props = vk.vkGetPhysicalDeviceProperties(pd)
            if (props.vendorID, props.deviceID) != (vendor_id, device_id):
                continue
            mem = vk.vkGetPhysicalDeviceMemoryProperties(pd)
            local = [int(mem.memoryHeaps[i].size) for i in range(mem.memoryHeapCount)
                     if mem.memoryHeaps[i].flags & vk.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT]
            return max(local) if local else None
        return None
    except vk.VkError:
        return None
    finally:
        vk.vkDestroyInstance(instance, None)
